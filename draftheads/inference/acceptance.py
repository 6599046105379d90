"""What a drafted node is worth: the probability that verification accepts it, from the draft's own
confidence, calibrated on-line against what the target emitted.

The model is conditional: a node's *confidence* is the draft's probability of its token given its parent
(``exp`` of the step in ``Tree.scores``, the cumulative log-probabilities EAGLE-2 ranks by); a proposer
that gives no scores (n-gram) puts every node in one bin. A cell of depth and confidence bin holds the
decayed (accepted, tried) counts of nodes whose parent was accepted, and a node's value, the probability
that the walk accepts it, is the product of its path's cells. Counts are kept at two levels:

* **shared** by every request of the engine, starting from the prior that the draft is calibrated as well
  as it proved to be at that depth (:meth:`AcceptanceModel.scale`);
* **per request**, starting from the shared estimate, so a domain where the same confidence means
  less (or more) is learnt within a few steps of that request, and decays faster, so a request whose
  drafts turn good after a run of rejections is believed again.

**Every drafted node is labelled, verified or not.** With children drafted deterministically (top-k, no
draft distribution), the walk emits the token the target draws after the accepted node, whatever
siblings the tree gives it, and a child is accepted exactly when its token is that one. So once a step
is verified, every drafted child of the emitted path (the accepted nodes and the one the bonus token
matches) is labelled by the emitted token, including the nodes the policy left out: the model learns
what the nodes it does not verify are worth, not only the ones it chose. Sampled children (a draft
distribution, accepted with probability min(1, p/q)) are labelled only where they were verified.

The walk's continuation (``reach``): per depth, how often a matched node with children drafted there
had one the target went on to. It predicts what drafting one more depth returns before it is drafted.
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
    _shared_rate: dict = field(default_factory=dict, repr=False)  # depth group -> shared estimate per bin, until the next observation

    def __post_init__(self):
        self.shared.decay = self.shared_decay

    def start(self, rid: int) -> None:
        self.requests[rid] = Cells(self.request_decay)

    def finish(self, rid: int) -> None:
        self.requests.pop(rid, None)

    def probability(self, rid: int | None, depth: int, step: float | None) -> float:
        """Probability that a node at ``depth`` is accepted once its parent is, where ``step`` is the
        draft's log-probability of its token given the parent (None: no confidence). A shared cell's prior
        is its confidence times the depth's :meth:`scale` (unscored nodes: ``UNKNOWN_PRIOR`` at depth 1,
        the estimate one depth up below it); a request's cell starts from the shared one."""
        return self.rates(rid, depth)[conf_bin(step)]

    def rates(self, rid: int | None, depth: int) -> list[float]:
        """:meth:`probability` at ``depth`` for every confidence bin (``UNKNOWN`` last)."""
        g = depth_group(depth)
        shared = self._shared_rate.get(g)
        if shared is None:
            f = self.scale(g)
            unknown = UNKNOWN_PRIOR if g == 1 else self.rates(None, g - 1)[UNKNOWN]  # as one depth up
            prior = [min(0.95, c * f) for c in CENTRES] + [unknown]
            shared = self._shared_rate[g] = [self.shared.rate(g, b, p, self.prior_weight) for b, p in enumerate(prior)]
        own = self.requests.get(rid)
        return shared if own is None else [own.rate(g, b, p, self.request_weight) for b, p in enumerate(shared)]

    def scale(self, g: int) -> float:
        """How much more (or less) often the shared cells of depth group ``g`` are accepted than their
        confidence says, over every bin: the prior of a cell seldom drafted, so an under- or
        over-confident draft is believed as it has proved itself where it drafts often. Each depth's
        scale starts from the one above it (1 at depth 1)."""
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
        """Per node, the probability that the walk accepts it (the root: 1): its parent's times its own
        given the parent."""
        d = depths(tree.parents)
        out = [1.0] * len(tree)
        rates: dict[int, list[float]] = {}
        for i in range(1, len(tree)):
            if d[i] not in rates:
                rates[d[i]] = self.rates(rid, d[i])
            out[i] = out[tree.parents[i]] * rates[d[i]][conf_bin(step_score(tree, i))]
        return out

    def observe(self, rid: int | None, tree: Tree, emitted: list[int]) -> None:
        """Label every drafted child of the path the target emitted (``emitted``: the accepted tokens and
        the bonus token) in ``tree``: the tree verified, or the whole drafted pool when its children were
        drafted deterministically (see the module docstring); and count the walk's continuation."""
        if len(tree) < 2:
            return
        kids = tree.children()
        cells = [self.shared] + ([self.requests[rid]] if rid in self.requests else [])
        self._shared_rate.clear()
        for c in cells:
            c.fade()
        node = 0
        for depth, tok in enumerate(emitted, 1):
            if not kids[node]:
                break
            g = depth_group(depth)
            nxt = None
            for i in kids[node]:
                hit = tree.tokens[i] == tok
                if hit and nxt is None:
                    nxt = i
                b = conf_bin(step_score(tree, i))
                for c in cells:
                    c.hits[g][b] += float(hit)
                    c.tries[g][b] += 1.0
            for c in cells:
                c.reached[g] += 1.0
                c.went_on[g] += float(nxt is not None)
            if nxt is None:
                break
            node = nxt


def step_score(tree: Tree, i: int) -> float | None:
    """The draft's log-probability of node ``i``'s token given its parent (None: the tree has no scores)."""
    if tree.scores is None:
        return None
    return tree.scores[i] - tree.scores[tree.parents[i]]
