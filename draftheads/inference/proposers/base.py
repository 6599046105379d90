"""The proposer interface: ``propose(state, tree) -> Tree`` (``propose_batch`` for a step's rows) plus
hooks to follow the committed sequence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from draftheads.errors import DraftheadsError
from draftheads.inference.sampling import SamplingParams
from draftheads.inference.tree import Tree, TreeSpec
from draftheads.metrics import SpecMetrics


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
    gate: object | None = None  # the engine's ``auto`` policy: whether this request drafts (its RowGate)

    @property
    def root(self) -> int:
        return self.tokens[-1]

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def kv_len(self) -> int:
        return len(self.tokens) - 1


class Growth(Protocol):
    """How deep a step drafts, decided as it drafts (the engine's ``auto`` policy)."""

    def more(self, depth: int, scores: torch.Tensor, parents: torch.Tensor) -> bool:
        """After drafting the nodes at ``depth`` (every row that drafts; scores [rows, n]: their cumulative
        log-probabilities; parents [rows, n]: each one's parent as an index into the nodes of all depths
        so far in the order drafted, -1 at depth 1): whether to draft depth + 1."""


class Proposer:
    """Drafts a candidate tree rooted at each request's last emitted token.

    ``layer_ids``: target hidden-state ids (HF numbering) the proposer needs; the engine captures them
    in every target forward and hands over those of committed tokens through :meth:`observe`, on plain
    steps too. Work on them (a draft forward) belongs in :meth:`propose`, so that a step the engine
    decodes plainly costs the proposer nothing.

    ``auto_pool``: the largest tree a step drafts under ``--tree auto``, whose nodes the policy values and
    keeps as many of as pay (and, drafting depth by depth, how deep it goes).
    """

    name = "none"
    layer_ids: tuple[int, ...] = ()
    auto_pool: TreeSpec = TreeSpec(depth=8, top_k=4, total_tokens=64, name="auto")
    width_by_rows = False
    """Whether each drafted depth is a forward over rows × ``top_k`` tokens (drafting depth by depth), so
    that under ``auto`` a wider draft costs as more rows do."""

    def check_tree(self, tree: TreeSpec) -> None:
        """Raise :class:`DraftheadsError` when this proposer cannot draft ``tree``."""
        if tree.paths is not None:
            raise DraftheadsError(
                f"the {self.name} proposer drafts dynamic trees: tree file {tree.name} is a static shape "
                "(for Medusa heads); use small, medium, large or chainK"
            )

    def start(self, state: RequestState, hidden: dict[int, torch.Tensor]) -> None:
        """After prefill: ``hidden[id]`` [prompt_len, H] for the prompt tokens."""

    def propose(self, state: RequestState, tree: TreeSpec) -> Tree:  # pragma: no cover - interface
        """A tree of at most ``tree.total_tokens`` nodes and depth ``tree.depth``, rooted at ``state.root``."""
        raise NotImplementedError

    def propose_batch(self, states: list[RequestState], tree: TreeSpec, grow: Growth | None = None) -> list[Tree]:
        """:meth:`propose` for several requests in one step (proposers that batch their drafting
        override it). ``grow``: asked after each drafted depth whether to draft the next, by proposers
        that draft depth by depth (the others draft ``tree.depth`` at once)."""
        return [self.propose(st, tree) for st in states]

    def observe(self, state: RequestState, hidden: dict[int, torch.Tensor], num_new: int) -> None:
        """After a verification: ``hidden[id]`` [num_new, H] for the newly committed tokens (the old root
        and the accepted drafts); ``state.tokens`` already holds the emitted tokens."""

    def finish(self, state: RequestState) -> None:
        """The request is done; drop its state."""


class FollowingProposer(Proposer):
    """A proposer that keeps, per request, the target's hidden states of committed tokens as they arrive
    and works on them only when a draft is asked for (:meth:`take_pending`), so plain steps cost nothing
    and drafting after a plain stretch catches up in one forward. Subclasses set ``state_type``, a
    dataclass with a ``pending`` list."""

    state_type: type

    def __init__(self):
        self.states: dict = {}

    def start(self, st: RequestState, hidden: dict[int, torch.Tensor]) -> None:
        self.states[st.rid] = self.state_type(pending=[hidden])

    def observe(self, st: RequestState, hidden: dict[int, torch.Tensor], num_new: int) -> None:
        self.states[st.rid].pending.append(hidden)

    def finish(self, st: RequestState) -> None:
        self.states.pop(st.rid, None)

    def take_pending(self, st: RequestState) -> dict[int, torch.Tensor] | None:
        """The hidden states [n, H] per layer id that arrived since the last draft (None if none), cleared."""
        state = self.states[st.rid]
        if not state.pending:
            return None
        hidden = {i: torch.cat([h[i] for h in state.pending]) for i in state.pending[0]}
        state.pending = []
        return hidden

