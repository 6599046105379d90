"""Synthetic acceptance (like vLLM's synthetic mode), for speed measurements on random-weight targets:
drafts a chain of K arbitrary tokens and tells the engine to accept position i with probability
``rates[i]`` (given the positions before it were accepted). Output text is meaningless by design."""

from __future__ import annotations

import torch

from draftheads.errors import DraftheadsError
from draftheads.inference.proposers.base import Proposer, RequestState
from draftheads.inference.tree import Tree, chain_parents


class SyntheticProposer(Proposer):
    name = "synthetic"

    def __init__(self, rates: list[float], seed: int = 0):
        if not rates or not all(0 <= r <= 1 for r in rates):
            raise DraftheadsError(f"synthetic acceptance rates {rates} must be a non-empty list in [0, 1]")
        self.rates = list(rates)
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, state: RequestState) -> Tree:
        return Tree([state.root] + [state.root] * len(self.rates), chain_parents(len(self.rates)))

    def accepted_length(self) -> int:
        n = 0
        for r in self.rates:
            if float(torch.rand((), generator=self.gen)) >= r:
                break
            n += 1
        return n
