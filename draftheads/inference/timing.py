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
  tokens emitted per target forward (tau counting every step; 1 for a plain engine, which makes the A/A
  control checked alike). An item on which some method measures more than ``DISTURBED`` times that bound
  was disturbed (another job, a stall): the whole item, every method, is measured again (up to ``retries``
  times) and flagged if it stays above. Only the whole item is measured again, never the one pair: a
  re-measurement chosen by its own outcome would replace plain's slow draws and keep its fast ones,
  biasing every ratio, the A/A control's included, below 1. A pair only slightly above the bound is noise
  and is kept; a result whose pooled or median ratio exceeds the bound is marked ``above_bound``.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from draftheads.inference.sampling import SamplingParams
from draftheads.metrics import SpecMetrics

SLACK = 1.02  # timer resolution and prefill noise
DISTURBED = 1.25  # this far above the bound is not run-to-run noise (about 10 % here): the item was disturbed


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
        median = statistics.median(pairs) if pairs else float("nan")
        m = self.metrics(method) if any(r.metrics is not None for r in self.runs[method]) else None
        return {"speedup": pooled, "median": median, "q25": q[0], "q75": q[2], "ci95": [lo, hi], "pairs": len(pairs),
                "flagged": len(self.flagged.get(method, [])),
                "above_bound": not (plausible(pooled, m) and plausible(median, m))}


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


def plausible(speedup: float, metrics: SpecMetrics | None, slack: float = SLACK) -> bool:
    """Whether ``speedup`` is within ``slack`` of what the run's tokens per forward allow (always, without
    metrics: HF ``generate`` has none)."""
    return metrics is None or not metrics.emitted_tokens or speedup <= slack * max(1.0, tokens_per_forward(metrics))


def generation_run(engine, prompts: list[list[int]], params) -> Run:
    """Time one ``engine.generate`` call."""
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    m = SpecMetrics()
    for o in outs:
        m = m.merge(o.metrics)
    return Run(dt, m.emitted_tokens, m, outs)


def warm_up(engines, prompt: list[int]) -> None:
    for e in engines:
        e.generate([prompt[:8]], SamplingParams(max_new_tokens=2))


def interleaved(methods: dict[str, Callable[[object], Run]], items: list, base: str = "plain",
                retries: int = 2, progress: Callable[[int], None] | None = None, seed: int = 0) -> Timings:
    """Run every method on every item, in a seeded random order per item; measure an item again, every
    method of it, while some method's speedup over ``base`` on it is far beyond what its tokens per
    forward allow. ``progress(i)`` after item i."""
    names = list(methods)
    rng = random.Random(seed)
    t = Timings(runs={n: [] for n in names})

    def disturbed(got: dict[str, Run]) -> list[str]:
        return [n for n in names if n != base and base in got
                and not plausible(got[base].seconds / got[n].seconds, got[n].metrics, DISTURBED)]

    for i, item in enumerate(items):
        for _ in range(retries + 1):
            got = {n: methods[n](item) for n in rng.sample(names, len(names))}
            if not (bad := disturbed(got)):
                break
        for n in bad:
            t.flagged.setdefault(n, []).append(i)
        for n in names:
            t.runs[n].append(got[n])
        if progress:
            progress(i)
    return t
