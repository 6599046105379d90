"""What a drafted node is worth: the probability that verification accepts it, from the draft's own
confidence, calibrated on-line against what verification actually accepted.

A node's *confidence* is the draft's cumulative probability of its path (``exp`` of ``Tree.scores``,
EAGLE-2's ranking value); a proposer that gives no scores (n-gram) puts every node in one bin. The
model keeps decayed counts of (accepted, drafted) per cell of depth and confidence bin, at two levels:

* **shared** by every request of the engine, starting from the prior that the draft is calibrated
  (a node of confidence c is accepted with probability c);
* **per request**, starting from the shared estimate, so a domain where the same confidence means
  less (or more) is learnt within a few steps of that request, and decays faster, so a request whose
  drafts turn good after a run of rejections is believed again.

Every verified node is an observation, accepted or not: acceptance is a property of the drafter and
the text, not of the tree that carried the node, so every tree the proposer could draft is valued by
the same model. A node's value is capped by its parent's (a node is accepted only after its parent),
so the best nodes by value always form a tree.

The walk's continuation (``reach``): per depth, how often the walk that reached depth d - 1 went on to
depth d when the tree had children there. It predicts what drafting one more depth returns before the
depth is drafted.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from draftheads.inference.tree import Tree, depths

EDGES = (0.01, 0.03, 0.06, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
"""Confidence bin edges (cumulative draft probability of a node's path)."""
CENTRES = tuple((lo + hi) / 2 for lo, hi in zip((0.0, *EDGES), (*EDGES, 1.0)))
UNKNOWN = len(CENTRES)
"""The bin of nodes whose proposer gives no confidence."""
UNKNOWN_PRIOR = 0.3
DEPTH_GROUPS = 6
"""Depths 1 .. 5 each have their own cells; deeper nodes share the last."""


def conf_bin(score: float | None) -> int:
    """Bin of a node with cumulative log-probability ``score`` (None: unknown)."""
    return UNKNOWN if score is None else bisect.bisect_right(EDGES, math.exp(min(score, 0.0)))


def depth_group(depth: int) -> int:
    return min(depth, DEPTH_GROUPS - 1)


@dataclass
class Cells:
    """Decayed accepted / drafted counts per (depth group, confidence bin), and per depth of the walk."""

    decay: float
    hits: list[list[float]] = field(default_factory=lambda: [[0.0] * (UNKNOWN + 1) for _ in range(DEPTH_GROUPS)])
    tries: list[list[float]] = field(default_factory=lambda: [[0.0] * (UNKNOWN + 1) for _ in range(DEPTH_GROUPS)])
    went_on: list[float] = field(default_factory=lambda: [0.0] * DEPTH_GROUPS)
    reached: list[float] = field(default_factory=lambda: [0.0] * DEPTH_GROUPS)

    def fade(self) -> None:
        f = self.decay
        for row in (*self.hits, *self.tries):
            for i in range(len(row)):
                row[i] *= f
        for row in (self.went_on, self.reached):
            for i in range(len(row)):
                row[i] *= f

    def rate(self, g: int, b: int, prior: float, weight: float) -> float:
        return (self.hits[g][b] + weight * prior) / (self.tries[g][b] + weight)

    def reach(self, g: int, prior: float, weight: float) -> float:
        return (self.went_on[g] + weight * prior) / (self.reached[g] + weight)


@dataclass
class AcceptanceModel:
    """Calibrated acceptance of drafted nodes: shared cells, and one set per request (``start`` /
    ``finish`` by request id)."""

    shared_decay: float = 0.995
    request_decay: float = 0.9
    prior_weight: float = 2.0  # pseudo-observations of the calibrated-draft prior in the shared cells
    request_weight: float = 4.0  # pseudo-observations of the shared estimate in a request's cells
    shared: Cells = field(default_factory=lambda: Cells(0.995))
    requests: dict[int, Cells] = field(default_factory=dict)
    _shared_rate: dict = field(default_factory=dict, repr=False)  # (group, bin) -> shared estimate, until the next observation

    def __post_init__(self):
        self.shared.decay = self.shared_decay

    def start(self, rid: int) -> None:
        self.requests[rid] = Cells(self.request_decay)

    def finish(self, rid: int) -> None:
        self.requests.pop(rid, None)

    def probability(self, rid: int | None, depth: int, score: float | None) -> float:
        """Probability that a node at ``depth`` with cumulative log-probability ``score`` is accepted. A
        shared cell's prior is its confidence times the depth's :meth:`scale` (unscored nodes: the cell one
        depth up times ``UNKNOWN_PRIOR``), so what is learnt where the draft is verified often carries to
        the cells it rarely reaches; a request's cell starts from the shared one."""
        b, g = conf_bin(score), depth_group(depth)
        own = self.requests.get(rid)
        p = self._shared_rate.get((g, b))
        if p is None:
            p = self._shared_rate[g, b] = self._shared(g, b)
        return p if own is None else own.rate(g, b, p, self.request_weight)

    def _shared(self, g: int, b: int) -> float:
        if b == UNKNOWN:
            p = UNKNOWN_PRIOR
            for d in range(1, g + 1):
                if d > 1:
                    p *= UNKNOWN_PRIOR  # a further unscored node also needs the one before it
                p = self.shared.rate(d, b, p, self.prior_weight)
            return p
        return self.shared.rate(g, b, min(0.95, CENTRES[b] * self.scale(g)), self.prior_weight)

    def scale(self, g: int) -> float:
        """How much more (or less) often the shared cells of depth group ``g`` are accepted than their
        confidence says, over every bin: the prior of a cell seldom verified (a low-ranked node, which a
        tree rarely carries), so an under- or over-confident draft is believed as it has proved itself
        where it is verified often. Each depth's scale starts from the one above it (1 at depth 1)."""
        f = 1.0
        for d in range(1, g + 1):
            hits = sum(self.shared.hits[d][:UNKNOWN])
            expected = sum(n * c for n, c in zip(self.shared.tries[d][:UNKNOWN], CENTRES))
            f = min(max((hits + self.prior_weight * f) / (expected + self.prior_weight), 0.25), 4.0)
        return f

    def reach(self, rid: int | None, depth: int) -> float:
        """Probability that the walk goes on to ``depth`` once it reached ``depth - 1`` with children there
        (the prior of each depth: the one before it)."""
        p = 0.5
        for g in range(1, depth_group(depth) + 1):
            p = self.shared.reach(g, p, self.prior_weight)
        own = self.requests.get(rid)
        return p if own is None else own.reach(depth_group(depth), p, self.request_weight)

    def values(self, rid: int | None, tree: Tree) -> list[float]:
        """Per node, the probability that it is accepted (the root: 1), each capped by its parent's."""
        d = depths(tree.parents)
        scores = tree.scores
        out = [1.0] * len(tree)
        for i in range(1, len(tree)):
            p = self.probability(rid, d[i], None if scores is None else scores[i])
            out[i] = min(p, out[tree.parents[i]])
        return out

    def observe(self, rid: int | None, tree: Tree, accepted: list[int]) -> None:
        """Count every drafted node of a verified tree (accepted or not) and the walk's depth."""
        if len(tree) < 2:
            return
        d = depths(tree.parents)
        kids = tree.children()
        took = set(accepted)
        cells = [self.shared] + ([self.requests[rid]] if rid in self.requests else [])
        self._shared_rate.clear()
        for c in cells:
            c.fade()
        for i in range(1, len(tree)):
            g, b = depth_group(d[i]), conf_bin(None if tree.scores is None else tree.scores[i])
            hit = float(i in took)
            for c in cells:
                c.hits[g][b] += hit
                c.tries[g][b] += 1.0
        walk = [0, *accepted]
        for j, node in enumerate(walk):  # reached depth j at ``node``; did it go on where it could?
            if kids[node]:
                g = depth_group(j + 1)
                for c in cells:
                    c.reached[g] += 1.0
                    c.went_on[g] += float(j + 1 < len(walk))
