"""N-gram / prompt-lookup proposer: no model. Finds the most recent earlier occurrence of the
context's last n tokens (n from ``max_n`` down to ``min_n``) and drafts the tokens that followed it
as a chain."""

from __future__ import annotations

from draftheads.errors import DraftheadsError
from draftheads.inference.proposers.base import Proposer, RequestState
from draftheads.inference.tree import Tree, TreeSpec, chain_parents


class NGramProposer(Proposer):
    name = "ngram"
    auto_pool = TreeSpec(depth=8, top_k=1, total_tokens=9, name="auto")

    def __init__(self, max_n: int = 4, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise DraftheadsError(f"ngram proposer needs 1 <= min_n <= max_n (got {min_n}, {max_n})")
        self.max_n, self.min_n = max_n, min_n

    def check_tree(self, tree: TreeSpec) -> None:
        if not tree.is_chain:
            raise DraftheadsError(f"the ngram proposer drafts chains: use chainK (or auto), not {tree.label}")

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == tail:
                    cont = tokens[start + n : start + n + k]
                    if cont:
                        return cont
        return []

    def propose(self, state: RequestState, tree: TreeSpec) -> Tree:
        draft = self.lookup(state.tokens, tree.depth)
        return Tree([state.root, *draft], chain_parents(len(draft)))
