"""What a step costs on this machine, measured as the engine runs: the target's verify forward by the
number of query tokens in it (the verify curve, seeded by ``draftheads profile``), and the draft by
batch size and depth.

Both are optimistic where they have not measured: a forward over more query tokens than any measured
costs the largest one measured plus, per further token, the least a token cost between two sizes
measured (the curve is flat while reading the weights dominates, then grows). The step from plain
decoding's size to the first tree is not such a slope: a tree's forward also pays for its attention
mask, once, so it is left out, and with one tree size measured the curve is flat past it. One more
draft depth costs at least a quarter of the first. So a larger
tree or a deeper draft is tried once before it is ruled out, and then it is known. The optimism has a
reach: a step verifies at most twice the query tokens of the largest size measured (:meth:`CostCurve.reach`),
so sizes are explored by doubling, not with one forward over hundreds of tokens whose cost is a
straight line drawn from a few small ones.

The cost of a forward depends on the batch as well as on its query tokens (every row reads its own
context): the policy keeps a curve per batch size (:class:`BatchCurves`). A batch size first seen
borrows the shape of the nearest one measured, and its first measurement sets its level.

The machine's speed drifts (plain decoding here went from 22 to 14 tok/s within an hour), and a size
measured long ago would be judged by another speed. Every measurement moves one drift factor by its
ratio to the curve's estimate, and the curve keeps its points at the speed of the factor: sizes
measured at different times stay comparable.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace

GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256)
"""Query-token counts the curve keeps points at (a step is counted at the next one up)."""


def grid_key(tokens: int) -> int:
    """The grid point a forward of ``tokens`` query tokens is kept at (powers of two past the grid)."""
    i = bisect.bisect_left(GRID, tokens)
    return GRID[i] if i < len(GRID) else 1 << math.ceil(math.log2(tokens))


@dataclass
class CostCurve:
    """Seconds of a verify forward by query tokens: a mean per grid point (the curve's shape, learnt fast
    at first, then slowly), times a drift factor every measurement moves (the machine's speed now)."""

    drift_rate: float = 0.1
    min_rate: float = 0.05  # a point's mean moves at least this share of the way to each measurement
    explore: float = 0.1
    seed_count: int = 20  # a profiled point counts as this many measurements
    points: dict[int, list[float]] = field(default_factory=dict)  # grid key -> [seconds / drift, count]
    drift: float = 1.0
    seen: set = field(default_factory=set)
    measured: int = 0  # forwards measured since the points were set (the first ones set the drift outright)
    plain: int = 0  # grid key of a plain forward (the batch size) at this curve: the step from it is no slope
    own: dict[int, int] = field(default_factory=dict)  # grid key -> forwards of this curve's own counted there

    def seed(self, ms_by_tokens: dict[int, float]) -> None:
        """Points from ``draftheads profile`` (milliseconds by query tokens)."""
        for n, ms in ms_by_tokens.items():
            self.points[grid_key(int(n))] = [ms / 1000 / self.drift, float(self.seed_count)]
            self.seen.add(grid_key(int(n)))
            self.own[grid_key(int(n))] = self.seed_count  # profiled on this machine

    def add(self, tokens: int, seconds: float) -> None:
        """One measured forward. The first at each size ran its kernel shapes cold: not counted."""
        key = grid_key(tokens)
        if key not in self.seen:
            self.seen.add(key)
            return
        est = self.estimate(tokens, optimistic=False)  # the drift is read off the points as measured
        if est:
            ratio = min(max(seconds / est, 0.5), 2.0)  # one stalled step moves the factor a little
            self.measured += 1
            self.drift *= ratio ** max(self.drift_rate, 1 / self.measured)
        self.own[key] = self.own.get(key, 0) + 1
        p = self.points.setdefault(key, [0.0, 0.0])
        p[1] += 1
        p[0] += max(1 / p[1], self.min_rate) * (seconds / self.drift - p[0])

    def _known(self, optimistic: bool = True) -> list[tuple[int, float]]:
        """The points as measured, or ``optimistic``: a point of few measurements lowered by its
        uncertainty (``explore`` / sqrt(count)), and none dearer than a larger size measured (a forward
        over more tokens is not faster). A size first measured on a slow or cold step is so tried again
        rather than ruled out for good (a profiled point, or one measured as often, is taken as it is)."""
        pts = sorted((n, t * (1 - self.explore / math.sqrt(count)) if optimistic and count < self.seed_count else t)
                     for n, (t, count) in self.points.items() if count > 0)
        if optimistic:
            for i in range(len(pts) - 2, -1, -1):
                pts[i] = (pts[i][0], min(pts[i][1], pts[i + 1][1]))
        return pts

    def estimate(self, tokens: int, optimistic: bool = True) -> float | None:
        """Seconds of a forward of ``tokens`` query tokens, interpolated between measured sizes; None
        outside them."""
        known = self._known(optimistic)
        keys = [n for n, _ in known]
        i = bisect.bisect_left(keys, tokens)
        if not known or i == len(known) or (i == 0 and keys[0] != tokens):
            return None
        if keys[i] == tokens or i == 0:
            return known[i][1] * self.drift
        (n0, t0), (n1, t1) = known[i - 1], known[i]
        return (t0 + (t1 - t0) * (tokens - n0) / (n1 - n0)) * self.drift

    def optimistic(self, tokens: int) -> float | None:
        """:meth:`estimate`, or past the largest size measured, that size's time plus the least slope
        between two sizes measured for every further token (the step up from the plain size left out);
        below the smallest, the smallest's. None before any measurement."""
        return self.table(tokens, tokens)[0]

    def table(self, lo: int, hi: int) -> list[float | None]:
        """:meth:`optimistic` for every token count from ``lo`` to ``hi``, in one pass."""
        known = self._known()
        if not known:
            return [None] * (hi - lo + 1)
        out, i, top = [], 0, 0.0
        slopes = [(t1 - t0) / (n1 - n0) for (n0, t0), (n1, t1) in zip(known, known[1:]) if n0 != self.plain]
        slope = max(min(slopes), 0.0) if slopes else 0.0  # per token past the largest size
        for q in range(lo, hi + 1):
            while i < len(known) and known[i][0] < q:
                top = max(top, known[i][1])
                i += 1
            if i < len(known) and known[i][0] == q:
                t = known[i][1]
            elif i == 0:
                t = known[0][1]
            elif i == len(known):
                t = top + slope * (q - known[-1][0])
            else:
                (n0, t0), (n1, t1) = known[i - 1], known[i]
                t = t0 + (t1 - t0) * (q - n0) / (n1 - n0)
            out.append(t * self.drift)
        return out

    def borrow(self, trust: float) -> CostCurve:
        """A curve for another batch size, of this one's shape: its points held as at most ``trust``
        measurements each (so they are explored), and the first forward measured at a size sets its
        level (the drift) outright."""
        return replace(self, points={k: [t, min(c, trust)] for k, (t, c) in self.points.items()}, seen=set(), measured=0,
                       own={})

    def reach(self) -> int | None:
        """The most query tokens a step may verify: twice the largest size measured (None before any)."""
        return 2 * max((n for n, (_, count) in self.points.items() if count > 0), default=0) or None

    def measured_at(self, tokens: int) -> int:
        """Forwards of ``tokens`` query tokens this curve counted itself (profiled ones included; the
        points it borrowed from another batch size not)."""
        return self.own.get(grid_key(tokens), 0)

    def weight(self, tokens: int) -> float:
        """How many measurements the point of ``tokens`` holds."""
        p = self.points.get(grid_key(tokens))
        return p[1] if p else 0.0


@dataclass
class BatchCurves:
    """A :class:`CostCurve` per batch size (by :func:`grid_key`): ``base`` is batch 1's (the one
    ``draftheads profile`` seeds); a batch size first seen starts from the curve of the nearest batch
    size, its points trusted as ``trust`` measurements each."""

    base: CostCurve = field(default_factory=lambda: CostCurve(plain=1))
    trust: float = 2.0
    curves: dict[int, CostCurve] = field(default_factory=dict)

    def at(self, batch: int) -> CostCurve:
        key = grid_key(batch)
        if key == 1:
            return self.base
        if key not in self.curves:
            known = {1: self.base, **self.curves}
            near = min(known, key=lambda k: (abs(math.log(k / key)), -k))
            self.curves[key] = replace(known[near].borrow(self.trust), plain=key)
        return self.curves[key]


@dataclass
class DraftCost:
    """Seconds of drafting ``depth`` levels for a batch of rows: decayed means per (batch key, depth)."""

    decay: float = 0.9
    first_share: float = 0.15  # before any measurement: the first depth as a share of a verify forward
    depth_share: float = 0.25  # before a second depth is measured: each further depth as a share of the first
    points: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    seen: set = field(default_factory=set)

    def add(self, batch: int, depth: int, seconds: float) -> None:
        """One measured draft; the first at each (batch, depth) ran its shapes cold: not counted."""
        key = (grid_key(batch), depth)
        if key not in self.seen:
            self.seen.add(key)
            return
        p = self.points.setdefault(key, [0.0, 0.0])
        p[0] = p[0] * self.decay + seconds
        p[1] = p[1] * self.decay + 1

    def estimate(self, batch: int, depth: int, verify: float | None = None) -> float:
        """Seconds to draft ``depth`` levels for ``batch`` rows: measured, or the line through the first
        depth and the measured per-depth increments (optimistic before they are measured); ``verify``,
        a verify forward's seconds, scales the guess before anything was measured."""
        if depth <= 0:
            return 0.0
        b = grid_key(batch)
        got = {d: s / w for (bb, d), (s, w) in self.points.items() if bb == b and w > 0}
        if depth in got:
            return got[depth]
        if not got:
            return self.first_share * (verify or 0.0) * (1 + self.depth_share * (depth - 1))
        d0 = min(got)
        first = got[d0] / (1 + self.depth_share * (d0 - 1))
        steps = [(got[d] - got[d0]) / (d - d0) for d in got if d > d0]
        per = sum(steps) / len(steps) if steps else self.depth_share * first
        return max(got[d0] + per * (depth - d0), 0.0) if depth > d0 else first * (1 + self.depth_share * (depth - 1))
