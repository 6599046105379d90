"""A proposer that drafts random tokens in the shape of the asked tree: useless as a drafter, it is the
proposer of speed measurements with the synthetic verifier and the worst case the policy must detect."""

from __future__ import annotations

import torch

from draftheads.inference.proposers.base import Proposer, RequestState
from draftheads.inference.tree import Tree, TreeSpec, chain_parents, static_tree


class RandomProposer(Proposer):
    name = "random"

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self.gen = torch.Generator().manual_seed(seed)

    def check_tree(self, tree: TreeSpec) -> None:
        pass  # any shape

    def propose(self, state: RequestState, tree: TreeSpec) -> Tree:
        parents = chain_parents(tree.depth) if tree.is_chain else static_tree(tree)[0]
        tokens = torch.randint(self.vocab_size, (len(parents) - 1,), generator=self.gen).tolist()
        return Tree([state.root, *tokens], parents)
