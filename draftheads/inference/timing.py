"""The one harness for "speculative vs plain" timings, used by eval, bench and the vLLM check.

* Every engine is warmed up first (one short generation each).
* Methods run interleaved: on each item (a prompt or a batch) and repeat, in a fresh seeded random
  order, so drift of the machine's speed falls on all methods alike, and no method always runs right
  after the same other one (a rotation keeps that adjacency, and it biased an A/A control by 5-7 %).
* Results: per method, per item and repeat, wall seconds, emitted tokens and the speculative metrics.
* Ratios: the pooled speedup (sum of plain wall time over sum of speculative), and the median of the
  per-pair ratios with its interquartile spread, which a few stalled runs on a noisy machine do not move,
  and a distribution-free 95 % confidence interval of that median (binomial order statistics): the
  claim "at least x times plain" is made by the interval's lower end, never by one lucky pair.
* Plausibility: a speculative step costs at least one plain forward, so the speedup cannot exceed the
  tokens emitted per target forward (tau counting every step). A pair that measures above that bound
  was disturbed; it is measured again (up to ``retries`` times) and flagged if it stays above.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from draftheads.inference.metrics import SpecMetrics
from draftheads.inference.sampling import SamplingParams

SLACK = 1.02  # timer resolution and prefill noise


@dataclass
class Run:
    seconds: float
    tokens: int
    metrics: SpecMetrics | None = None
    outputs: list | None = None


@dataclass
class Timings:
    """``runs[method][item]``: the kept run of each method on each item."""

    runs: dict[str, list[Run]] = field(default_factory=dict)
    flagged: dict[str, list[int]] = field(default_factory=dict)  # items whose ratio stayed implausible

    def seconds(self, method: str) -> float:
        return sum(r.seconds for r in self.runs[method])

    def tokens(self, method: str) -> int:
        return sum(r.tokens for r in self.runs[method])

    def rate(self, method: str) -> float:
        s = self.seconds(method)
        return self.tokens(method) / s if s else 0.0

    def metrics(self, method: str) -> SpecMetrics:
        m = SpecMetrics()
        for r in self.runs[method]:
            if r.metrics is not None:
                m = m.merge(r.metrics)
        return m

    def ratio(self, method: str, base: str = "plain") -> dict:
        """Speedup of ``method`` over ``base``: pooled, and the median of per-item ratios with quartiles."""
        pairs = [b.seconds / r.seconds for b, r in zip(self.runs[base], self.runs[method]) if r.seconds > 0]
        q = statistics.quantiles(pairs, n=4) if len(pairs) >= 2 else [pairs[0]] * 3 if pairs else [float("nan")] * 3
        pooled = self.seconds(base) / self.seconds(method) if self.seconds(method) else float("nan")
        lo, hi = median_ci(pairs)
        return {"speedup": pooled, "median": statistics.median(pairs) if pairs else float("nan"),
                "q25": q[0], "q75": q[2], "ci95": [lo, hi], "pairs": len(pairs),
                "flagged": len(self.flagged.get(method, []))}


def median_ci(xs: list[float], level: float = 0.95) -> tuple[float, float]:
    """Distribution-free confidence interval of the median of ``xs``: order statistics ``k`` and
    ``n - k + 1``, with ``k`` the largest rank whose binomial(n, 1/2) tail stays within (1 - level) / 2.
    Fewer than 6 values give the whole range (no narrower interval has the coverage)."""
    xs = sorted(xs)
    n = len(xs)
    if not n:
        return float("nan"), float("nan")
    tail, k, acc = (1 - level) / 2, 0, 0.0
    for j in range(n // 2):  # P(Binom(n, 1/2) <= j)
        acc += math.comb(n, j) / 2**n
        if acc > tail:
            break
        k = j + 1
    k = max(k, 1)
    return xs[k - 1], xs[n - k]


def tokens_per_forward(metrics: SpecMetrics) -> float:
    """Emitted tokens per target forward over every step (plain steps included): the speedup bound."""
    forwards = metrics.target_forwards + 1  # + the prefill, which emits the first token
    return metrics.emitted_tokens / forwards if forwards else 1.0


def plausible(speedup: float, metrics: SpecMetrics | None) -> bool:
    return metrics is None or not metrics.emitted_tokens or speedup <= SLACK * max(1.0, tokens_per_forward(metrics))


def generation_run(engine, prompts: list[list[int]], params) -> Run:
    """Time one ``engine.generate`` call."""
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    m = SpecMetrics()
    for o in outs:
        m = m.merge(o.metrics)
    return Run(dt, m.emitted_tokens, m if engine.proposer is not None else None, outs)


def warm_up(engines, prompt: list[int]) -> None:
    for e in engines:
        e.generate([prompt[:8]], SamplingParams(max_new_tokens=2))


def interleaved(methods: dict[str, Callable[[object], Run]], items: list, base: str = "plain",
                retries: int = 2, progress: Callable[[int], None] | None = None, seed: int = 0) -> Timings:
    """Run every method on every item, in a seeded random order per item; re-measure a pair whose speedup over
    ``base`` is physically impossible. ``progress(i)`` after item i."""
    names = list(methods)
    rng = random.Random(seed)
    t = Timings(runs={n: [] for n in names})
    for i, item in enumerate(items):
        order = rng.sample(names, len(names))
        got = {n: methods[n](item) for n in order}
        for n in names:
            if n == base or base not in got:
                continue
            for _ in range(retries):
                if plausible(got[base].seconds / got[n].seconds, got[n].metrics):
                    break
                pair = [base, n] if i % 2 else [n, base]
                got.update({m: methods[m](item) for m in pair})
            if not plausible(got[base].seconds / got[n].seconds, got[n].metrics):
                t.flagged.setdefault(n, []).append(i)
        for n in names:
            t.runs[n].append(got[n])
        if progress:
            progress(i)
    return t
