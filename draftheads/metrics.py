"""The one definition of speculative-decoding metrics, shared by training eval, engine and benchmarks.

Counts (vLLM ``spec_decode/metrics.py`` convention):

* a *draft* is one proposal verified by one target forward; its *length* is the number of drafted
  positions along the longest root-to-leaf path (a chain of K tokens has length K);
* ``accepted_per_pos[i]`` = drafts whose accepted prefix reached position i (0-based);
* ``drafts_per_pos[i]`` = drafts whose length was > i (drafts that could reach position i).

Derived:

* tau = 1 + accepted / drafts -- mean tokens emitted per target forward, bonus token included;
* alpha[i] = accepted_per_pos[i] / drafts_per_pos[i];
* acceptance rate = accepted / draft tokens;
* speedup = plain-decode wall time / speculative wall time on the same prompts and engine.

Simulated tau from per-step top-1 accuracies a_1..a_k (used in training validation):
1 + sum_k prod_{j<=k} a_j.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    """Accumulated counters for one request or many (``merge``)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    drafts_per_pos: list[int] = field(default_factory=list)
    emitted_tokens: int = 0
    target_forwards: int = 0
    wall_time_s: float = 0.0

    def record_draft(self, draft_len: int, num_accepted: int, draft_tokens: int | None = None) -> None:
        """One verified draft: ``draft_len`` positions drafted, ``num_accepted`` accepted (no bonus).

        ``draft_tokens`` counts all drafted tokens (a tree has more than its depth); defaults to
        ``draft_len``.
        """
        if not 0 <= num_accepted <= draft_len:
            raise ValueError(f"accepted {num_accepted} outside 0..{draft_len}")
        self.drafts += 1
        self.draft_tokens += draft_len if draft_tokens is None else draft_tokens
        self.accepted += num_accepted
        _grow(self.accepted_per_pos, draft_len)
        _grow(self.drafts_per_pos, draft_len)
        for i in range(draft_len):
            self.drafts_per_pos[i] += 1
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def merge(self, other: SpecMetrics) -> SpecMetrics:
        out = SpecMetrics(
            drafts=self.drafts + other.drafts,
            draft_tokens=self.draft_tokens + other.draft_tokens,
            accepted=self.accepted + other.accepted,
            emitted_tokens=self.emitted_tokens + other.emitted_tokens,
            target_forwards=self.target_forwards + other.target_forwards,
            wall_time_s=self.wall_time_s + other.wall_time_s,
        )
        n = max(len(self.drafts_per_pos), len(other.drafts_per_pos))
        for src in (self, other):
            _grow(out.accepted_per_pos, n)
            _grow(out.drafts_per_pos, n)
            for i, v in enumerate(src.accepted_per_pos):
                out.accepted_per_pos[i] += v
            for i, v in enumerate(src.drafts_per_pos):
                out.drafts_per_pos[i] += v
        return out

    @property
    def tau(self) -> float:
        """Mean accepted length including the bonus token; 1.0 with no drafts (plain decoding)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def alpha(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafts_per_pos)]

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.emitted_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def summary(self) -> dict:
        return {
            "tau": self.tau,
            "alpha": self.alpha,
            "acceptance_rate": self.acceptance_rate,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted": self.accepted,
            "accepted_per_pos": list(self.accepted_per_pos),
            "drafts_per_pos": list(self.drafts_per_pos),
            "emitted_tokens": self.emitted_tokens,
            "target_forwards": self.target_forwards,
            "wall_time_s": self.wall_time_s,
            "tokens_per_s": self.tokens_per_s,
        }

    def line(self) -> str:
        alphas = " ".join(f"{a:.2f}" for a in self.alpha)
        return (
            f"tau={self.tau:.2f} alpha@1..{len(self.alpha)}=[{alphas}] "
            f"accept={self.acceptance_rate:.2f} tok/s={self.tokens_per_s:.1f}"
        )


def _grow(xs: list[int], n: int) -> None:
    xs.extend([0] * (n - len(xs)))


def speedup(plain_wall_s: float, spec_wall_s: float) -> float:
    """Plain-decode wall time over speculative wall time, same prompts, same engine."""
    return plain_wall_s / spec_wall_s if spec_wall_s > 0 else math.nan


def simulated_tau(step_accuracies) -> float:
    """1 + sum_k prod_{j<=k} a_j from per-step top-1 accuracies."""
    tau, running = 1.0, 1.0
    for a in step_accuracies:
        running *= float(a)
        tau += running
    return tau


def mean_ci95(values) -> tuple[float, float]:
    """Mean and half-width of a normal-approximation 95 % confidence interval."""
    xs = [float(v) for v in values]
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, math.nan
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, 1.96 * math.sqrt(var / len(xs))
