"""The proposer interface: ``propose(state) -> Tree`` plus hooks to follow the committed sequence."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftheads.inference.metrics import SpecMetrics
from draftheads.inference.sampling import SamplingParams
from draftheads.inference.tree import Tree


@dataclass
class RequestState:
    """Per-request engine state (one batch row)."""

    rid: int
    prompt_len: int
    tokens: list[int]  # prompt + emitted tokens; tokens[-1] is the root, not yet in the target's cache
    params: SamplingParams
    generator: torch.Generator
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    done: bool = False
    speculate: bool = True  # a proposer (or the engine's policy) may turn drafting off per request

    @property
    def root(self) -> int:
        return self.tokens[-1]

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def kv_len(self) -> int:
        return len(self.tokens) - 1


class Proposer:
    """Drafts a candidate tree rooted at each request's last emitted token.

    ``layer_ids``: target hidden-state ids (HF numbering) the proposer needs; the engine captures them
    in every target forward and hands over those of committed tokens through :meth:`observe`.
    """

    name = "none"
    layer_ids: tuple[int, ...] = ()

    def start(self, state: RequestState, hidden: dict[int, torch.Tensor]) -> None:
        """After prefill: ``hidden[id]`` [prompt_len, H] for the prompt tokens."""

    def propose(self, state: RequestState) -> Tree:  # pragma: no cover - interface
        raise NotImplementedError

    def observe(self, state: RequestState, hidden: dict[int, torch.Tensor], num_new: int) -> None:
        """After a verification: ``hidden[id]`` [num_new, H] for the newly committed tokens (the old root
        and the accepted drafts); ``state.tokens`` already holds the emitted tokens."""

    def finish(self, state: RequestState) -> None:
        """The request is done; drop its state."""

    def set_tree(self, name: str) -> None:
        """Switch to the named tree (``--tree auto`` moves between them)."""
        raise NotImplementedError(f"{self.name} proposer has no tree options")
