"""Proposers for tests: an oracle that drafts the target's own greedy continuation, and random trees."""

import torch

from draftheads.inference.proposers.base import Proposer
from draftheads.inference.tree import Tree, chain_parents


class OracleProposer(Proposer):
    name = "oracle"

    def check_tree(self, tree):
        pass  # drafts its own shape

    def __init__(self, model, depth, siblings=0, vocab=None, seed=0):
        self.model, self.depth, self.siblings, self.vocab = model, depth, siblings, vocab
        self.gen = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def propose(self, st, tree=None):
        ids = torch.tensor([st.tokens])
        chain = []
        for _ in range(self.depth):  # run the target ahead, greedily, without a cache
            nxt = int(self.model(ids).logits[0, -1].argmax())
            chain.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
        tokens, parents = [st.root, *chain], chain_parents(len(chain))
        for node in range(len(chain)):  # optional wrong siblings beside every correct node
            for _ in range(self.siblings):
                tokens.append(int(torch.randint(self.vocab, (1,), generator=self.gen)))
                parents.append(node)
        return Tree(tokens, parents)


class RandomTreeProposer(Proposer):
    name = "random"

    def check_tree(self, tree):
        pass  # drafts its own shape

    def __init__(self, vocab, size=9, seed=0):
        self.vocab, self.size = vocab, size
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, st, tree=None):
        parents = [-1] + [int(torch.randint(i, (1,), generator=self.gen)) for i in range(1, self.size)]
        tokens = [st.root] + torch.randint(self.vocab, (self.size - 1,), generator=self.gen).tolist()
        return Tree(tokens, parents)
