"""N-gram / prompt-lookup proposer: no model. Finds the most recent earlier occurrence of the
context's last n tokens (n from ``max_n`` down to ``min_n``) and drafts the tokens that followed it
as a chain."""

from __future__ import annotations

from draftheads.errors import DraftheadsError
from draftheads.inference.proposers.base import Proposer, RequestState
from draftheads.inference.tree import Tree, chain_parents


class NGramProposer(Proposer):
    name = "ngram"

    def __init__(self, num_tokens: int = 4, max_n: int = 4, min_n: int = 1):
        if num_tokens < 1 or not 1 <= min_n <= max_n:
            raise DraftheadsError(f"ngram proposer needs num_tokens >= 1 and 1 <= min_n <= max_n (got {num_tokens}, {min_n}, {max_n})")
        self.k, self.max_n, self.min_n = num_tokens, max_n, min_n

    def set_tree(self, name: str) -> None:
        if not (name.startswith("chain") and name[5:].isdigit()):
            raise DraftheadsError(f"the ngram proposer drafts chains: use chainK, not {name!r}")
        self.k = int(name[5:])

    def lookup(self, tokens: list[int]) -> list[int]:
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == tail:
                    cont = tokens[start + n : start + n + self.k]
                    if cont:
                        return cont
        return []

    def propose(self, state: RequestState) -> Tree:
        draft = self.lookup(state.tokens)
        return Tree([state.root, *draft], chain_parents(len(draft)))
