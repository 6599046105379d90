"""Speculating only where it pays, from measurements on this machine (``--tree auto``).

The algorithm, per engine and across its ``generate`` calls:

* **Arms**: plain decoding and the proposer's trees (``Proposer.auto_trees``), cheapest first. Every
  measurement is kept per batch-size bucket (1, 2, 4, 8, ...), since what pays at batch 1 may not at 16.
* **Measurement**: a step is credited to the arm that actually ran -- a step in which no row drafted
  (every request switched off) is a plain step -- with its wall time, draft work included, and the
  tokens it moved the batch on by: the batch size times how much the most tokens any row still has to
  write went down. A batch's call ends with its last row, so a drafter accepted in one row and not in
  another saves no step, however many tokens the first row emits. An arm's first step in a bucket runs
  its kernel shapes cold, so its tokens count but its time does not. Token counts decay by ``decay`` per step of that bucket, chosen or not (a window
  of about ``1 / (1 - decay)`` steps), so old measurements fade.
* **Choice**: the arm with the best rate: decayed mean tokens per step over its step time.
  - The mean starts from ``prior_steps`` pseudo-steps at plain decoding's tokens per step (nothing
    accepted), so an arm measured in few steps -- one probed now and then, whose older steps have
    decayed away -- does not become the best on one lucky step; an arm that runs soon outweighs them.
  - Plain decoding's step time is the median of its last nine (a step stalled by other work on the
    machine does not move the median). A tree's is the median of its last nine step times over
    plain's at the time, times plain's now: a machine's speed drifts (here plain decoding went from
    22 to 14 tok/s within an hour), and a tree probed now and then would otherwise be judged by
    times from when the machine was faster or slower.
* **Exploration**: an arm is measured for ``explore_steps`` steps before it can be compared, cheapest
  first. In a new batch bucket an arm already explored in another one is not explored again when the
  tokens per row it emitted there (acceptance does not depend on the batch), over its step time here
  by the verify curve (at least that of the largest size measured below it), cannot beat plain
  decoding: it waits for its first probe instead, and holds back the larger trees of its kind as a
  losing tree does (below).
* **Probe schedule**: every arm that is not the best is tried for one step after ``probe_after``
  steps; each probe it loses doubles its wait (up to ``max_probe_after``), a win resets it.
  - The wait is counted in steps of the best arm's time: an arm whose step takes 4x as long waits 4x
    as many steps, so probing takes the same share of the time whatever a probe costs (at batch 16
    a probe that catches the drafter up over every row costs several plain steps).
  - While a tree runs below ``prune`` times the best arm, the larger trees of its kind (chains after
    a chain, branching trees after a branching tree) wait, unexplored ones included, until it comes
    close (the largest explored tree below them decides): they cost more per step and, with the same
    drafter, accept little more, so only the smallest losing tree of each kind is probed.
  - Chains and branching trees do not hold each other back, since their costs do not follow their
    sizes: on a CPU a 12-token tree can cost no more than a 2-token chain, whose two-row matrix
    products run as two one-row ones.
* **Large batch**: from the step times measured at each number of query tokens (the verify curve,
  seeded by ``draftheads profile`` where it was run), an arm is skipped when even its best case,
  every drafted token accepted, cannot beat plain decoding: (depth + 1) * t(batch) < t(batch * tree).
* **Per request** (:class:`RequestSwitch`): while a batch of several rows speculates, a request whose
  running tokens per step stays below the measured step-time ratio of the arm to plain decoding decodes
  plainly for ``off_steps`` steps, then probes again, so one row's rejections do not cost the others a
  wide verify. Its state lives on the request. A lone row is left to the arms, plain decoding among
  them: switching it off after a short run of rejections cost more than it saved at batch 1 with the
  shipped EAGLE-3 head (a third of the steps or more ran plain in two of three side-by-side runs).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from draftheads.inference.proposers.base import RequestState
from draftheads.inference.tree import TreeSpec, parse_tree


@dataclass
class ArmStats:
    tokens: float = 0.0  # decayed tokens emitted
    weight: float = 0.0  # decayed step count
    rows: float = 0.0  # decayed rows stepped (batch size summed)
    times: deque = field(default_factory=lambda: deque(maxlen=9))  # wall seconds of its last steps
    ratios: deque = field(default_factory=lambda: deque(maxlen=9))  # the same over plain's step time then
    steps: int = 0  # steps ever run
    probe_after: int = 0
    next_probe: int = 0
    explore_steps: int = 0  # steps before it can be compared; 0 once its exploration is skipped

    @property
    def step_time(self) -> float:
        """Median of the last step times: one step stalled by the machine does not move it."""
        return statistics.median(self.times) if self.times else 0.0

    def tokens_per_step(self, prior_tokens: float = 0.0, prior_steps: float = 0.0) -> float:
        """Decayed mean tokens per step, counting ``prior_steps`` pseudo-steps of ``prior_tokens`` each."""
        return (self.tokens + prior_steps * prior_tokens) / (self.weight + prior_steps) if self.weight else 0.0

    def decay(self, f: float) -> None:
        self.tokens *= f
        self.weight *= f
        self.rows *= f

    @property
    def explored(self) -> bool:
        return self.steps >= self.explore_steps

    def tokens_per_row(self, prior_steps: float) -> float:
        """Decayed mean tokens per row and step, counting ``prior_steps`` pseudo-steps of one token a row."""
        rows_per_step = self.rows / self.weight
        return self.tokens_per_step(rows_per_step, prior_steps) / rows_per_step


def _bucket(batch: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(batch, 1))))


@dataclass
class CostCurve:
    """Decayed mean step time by number of query tokens in the forward (power-of-two buckets)."""

    decay: float = 0.98
    points: dict[int, list[float]] = field(default_factory=dict)  # bucket -> [seconds sum, weight]

    def seed(self, ms_by_tokens: dict[int, float]) -> None:
        for n, ms in ms_by_tokens.items():
            self.points[_bucket(n)] = [ms / 1000, 1.0]

    def add(self, tokens: int, seconds: float) -> None:
        p = self.points.setdefault(_bucket(tokens), [0.0, 0.0])
        p[0] = p[0] * self.decay + seconds
        p[1] = p[1] * self.decay + 1

    def estimate(self, tokens: int) -> float | None:
        """Seconds of a step of ``tokens`` query tokens: interpolated, or extrapolated along the line
        through the two nearest measured sizes up to twice the largest; None with fewer than two, or
        further out (a line through 1 and 2 query tokens says nothing about 12: on a CPU a 12-token
        step can cost what a 2-token one does)."""
        known = sorted((n, s / w) for n, (s, w) in self.points.items() if w > 0)
        if len(known) < 2 or tokens > 2 * known[-1][0]:
            return None
        i = min(max(bisect.bisect_left([n for n, _ in known], tokens), 1), len(known) - 1)
        (n0, t0), (n1, t1) = known[i - 1], known[i]
        return t0 + (t1 - t0) * (tokens - n0) / (n1 - n0)

    def at_least(self, tokens: int) -> float | None:
        """Seconds of a step of ``tokens`` query tokens: the estimate where there is one, else a lower
        bound, the longest step measured at no more tokens (a forward over more tokens is not faster)."""
        est = self.estimate(tokens)
        if est is not None:
            return est
        below = [s / w for n, (s, w) in self.points.items() if w > 0 and n <= _bucket(tokens)]
        return max(below) if below else None


@dataclass
class AutoTree:
    trees: dict[str, TreeSpec]  # arm name -> tree, cheapest first; plain decoding is the arm None
    explore_steps: int = 3
    prior_steps: float = 1.0
    decay: float = 0.98
    prune: float = 1.0
    probe_after: int = 32
    max_probe_after: int = 1024
    curve: CostCurve = field(default_factory=CostCurve)
    stats: dict[int, dict[str | None, ArmStats]] = field(default_factory=dict)  # batch bucket -> arm -> stats
    steps: dict[int, int] = field(default_factory=dict)

    @classmethod
    def for_proposer(cls, proposer) -> AutoTree:
        """Plain decoding and the proposer's ``auto_trees``."""
        return cls({n: parse_tree(n) for n in proposer.auto_trees})

    @property
    def arms(self) -> list[str | None]:
        return [None, *self.trees]

    def _stats(self, b: int) -> dict[str | None, ArmStats]:
        if b not in self.stats:
            self.stats[b] = {a: ArmStats(probe_after=self.probe_after, explore_steps=self.explore_steps)
                             for a in self.arms}
            self.steps[b] = 0
        return self.stats[b]

    def can_pay(self, arm: str | None, batch: int, plain: float | None = None) -> bool:
        """False when, by the measured curve, even full acceptance cannot beat plain decoding
        (``plain``: the curve's estimate at ``batch``, when the caller has it)."""
        if arm is None:
            return True
        tree = self.trees[arm]
        plain = self.curve.estimate(batch) if plain is None else plain
        spec = self.curve.estimate(batch * tree.total_tokens)
        return plain is None or spec is None or (tree.depth + 1) * plain >= spec

    def choose(self, batch: int) -> str | None:
        """The arm for the next step of a batch of ``batch`` rows."""
        stats = self._stats(_bucket(batch))
        step = self.steps[_bucket(batch)] + 1
        plain = self.curve.estimate(batch)
        for a in self.trees:  # measured at another batch size and losing here: probed, not explored
            if not stats[a].explored and not stats[a].steps and self._loses_elsewhere(a, batch):
                stats[a].explore_steps = 0
                stats[a].next_probe = step + stats[a].probe_after
        best = self.best(batch)
        bar = self.prune * self._rate(stats, best, batch)
        arms = [a for a in self.arms if self.can_pay(a, batch, plain) and step >= stats[a].next_probe
                and not self._held_back(stats, a, batch, bar)]
        for a in arms:  # exploration, cheapest first
            if not stats[a].explored:
                return a
        for a in arms:  # a probe of an arm that is not the best, when its wait is over
            if a != best:
                return a
        return best

    def update(self, arm: str | None, batch: int, tokens: int, seconds: float, query_tokens: int) -> None:
        """Credit one step to the arm that ran (None when no row drafted)."""
        b = _bucket(batch)
        stats = self._stats(b)
        self.steps[b] += 1
        step = self.steps[b]
        for s in stats.values():
            s.decay(self.decay)
        s = stats[arm]
        s.tokens += tokens
        s.weight += 1
        s.rows += batch
        s.steps += 1
        if s.steps > 1:  # the first step ran this arm's shapes cold: its time is not what the arm costs
            s.times.append(seconds)
            if arm is not None and stats[None].times:
                s.ratios.append(seconds / stats[None].step_time)
            self.curve.add(query_tokens, seconds)
        if not s.explored:
            return
        best = self.best(batch)
        if arm == best:
            s.probe_after = self.probe_after
        elif s.steps > s.explore_steps:
            s.probe_after = min(2 * s.probe_after, self.max_probe_after)
        t_best = self._step_time(stats, best)
        cost = self._step_time(stats, arm) / t_best if arm != best and t_best else 1.0
        s.next_probe = step + round(s.probe_after * max(cost, 1.0))

    def _held_back(self, stats: dict[str | None, ArmStats], arm: str | None, batch: int, bar: float) -> bool:
        """True while the largest smaller tree of ``arm``'s kind that has been explored (or probed
        instead) runs below ``bar``."""
        below = [a for a in self._smaller_of_kind(arm) if stats[a].explored] if arm is not None else []
        return bool(below) and self._rate(stats, below[-1], batch) < bar

    def _loses_elsewhere(self, arm: str, batch: int) -> bool:
        """True when ``arm``, explored in another batch bucket, would run below plain decoding at
        ``batch`` with the tokens per row it emitted there and its step time here by the curve."""
        b = _bucket(batch)
        seen = [stats[arm] for bb, stats in self.stats.items() if bb != b and stats[arm].rows]
        if not seen:  # checked first: it is asked at every step while an arm waits unexplored
            return False
        t_plain = self._stats(b)[None].step_time or self.curve.estimate(batch)
        t_arm = self.curve.at_least(batch * self.trees[arm].total_tokens)
        if not t_plain or not t_arm:
            return False
        per_row = max(st.tokens_per_row(self.prior_steps) for st in seen)
        return per_row * batch / t_arm < self.prune * batch / t_plain

    def _smaller_of_kind(self, arm: str) -> list[str]:
        """The trees before ``arm`` that are chains if it is one, branching trees if it branches."""
        names = list(self.trees)
        chain = self.trees[arm].top_k == 1
        return [a for a in names[:names.index(arm)] if (self.trees[a].top_k == 1) == chain]

    def best(self, batch: int = 1) -> str | None:
        stats = self._stats(_bucket(batch))
        measured = [a for a in self.arms if stats[a].steps]
        return max(measured, key=lambda a: self._rate(stats, a, batch)) if measured else None

    def _rate(self, stats: dict[str | None, ArmStats], arm: str | None, batch: int) -> float:
        """``arm``'s rate with its mean pulled towards plain decoding's tokens per step (``batch`` until
        plain has run)."""
        plain = stats[None]
        base = plain.tokens / plain.weight if plain.weight else float(batch)
        t = self._step_time(stats, arm)
        return stats[arm].tokens_per_step(base, self.prior_steps) / t if t > 0 else 0.0

    @staticmethod
    def _step_time(stats: dict[str | None, ArmStats], arm: str | None) -> float:
        """Seconds of ``arm``'s step at the machine's speed now: a tree's through its ratios to plain."""
        s, plain = stats[arm], stats[None]
        if arm is None or not s.ratios or not plain.times:
            return s.step_time
        return statistics.median(s.ratios) * plain.step_time

    def cost_ratio(self, arm: str | None, batch: int) -> float | None:
        """Measured step time of ``arm`` over plain decoding's at this batch (None until both ran)."""
        stats = self._stats(_bucket(batch))
        plain, spec = stats[None], stats.get(arm)
        if arm is None or spec is None or not plain.weight or not spec.weight:
            return None
        return self._step_time(stats, arm) / plain.step_time


@dataclass
class RequestSwitch:
    """Turns speculation off for a request whose running tokens per step cannot beat ``cost_ratio``."""

    ema: float = 0.8
    off_steps: int = 16

    def observe(self, st: RequestState, tokens_emitted: int, step: int, cost_ratio: float) -> None:
        t = float(tokens_emitted) if st.spec_tau is None else st.spec_tau
        st.spec_tau = self.ema * t + (1 - self.ema) * tokens_emitted
        if st.spec_tau < cost_ratio:
            st.speculate = False
            st.plain_until = step + self.off_steps

    def maybe_probe(self, st: RequestState, step: int) -> None:
        if not st.speculate and step >= st.plain_until:
            st.speculate = True
            st.spec_tau = None
