"""Choosing how much to speculate, from measurements on this machine.

* :class:`AutoTree` (``--tree auto``): the candidate trees (and plain decoding) are arms; each step
  records tokens emitted per second of wall time for the arm used, and the arm with the best running
  rate is chosen, with periodic re-exploration. The verify-cost curve from ``draftheads profile``
  (when present) orders the first exploration by the expected rate tau / t(tree size).
* Per-request switch: a request whose running acceptance says speculation cannot pay for its extra
  verify cost (expected tau below the measured spec/plain step-time ratio) decodes plainly for a
  while, then probes again. At large batch the verify cost grows with the query tokens, the ratio
  rises, and speculation turns itself off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from draftheads.inference.proposers.base import RequestState


@dataclass
class ArmStats:
    tokens: float = 0.0
    seconds: float = 0.0
    weight: float = 0.0  # decayed step count
    steps: int = 0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def step_time(self) -> float:
        return self.seconds / self.weight if self.weight else 0.0


@dataclass
class AutoTree:
    arms: list[str | None]  # tree names; None = plain decoding
    explore_steps: int = 3  # steps per arm before exploiting
    reexplore_every: int = 40
    decay: float = 0.95  # exponential forgetting of old measurements
    prior: dict[str | None, float] = field(default_factory=dict)  # expected rate from the profile curve
    stats: dict = field(default_factory=dict)
    step: int = 0

    def __post_init__(self):
        self.stats = {a: ArmStats() for a in self.arms}
        self.arms = sorted(self.arms, key=lambda a: -self.prior.get(a, 0.0))

    def choose(self) -> str | None:
        self.step += 1
        for a in self.arms:
            if self.stats[a].steps < self.explore_steps:
                return a
        if self.step % self.reexplore_every == 0:
            return min(self.arms, key=lambda a: self.stats[a].steps)
        return max(self.arms, key=lambda a: self.stats[a].rate)

    def update(self, arm: str | None, tokens: int, seconds: float) -> None:
        s = self.stats[arm]
        s.tokens = s.tokens * self.decay + tokens
        s.seconds = s.seconds * self.decay + seconds
        s.weight = s.weight * self.decay + 1
        s.steps += 1

    def cost_ratio(self, arm: str | None) -> float | None:
        """Measured step time of ``arm`` over plain decoding's (None until both were measured)."""
        plain, spec = self.stats.get(None), self.stats.get(arm)
        if arm is None or plain is None or spec is None or not plain.weight or not spec.weight:
            return None
        return spec.step_time / plain.step_time

    def best(self) -> str | None:
        return max(self.arms, key=lambda a: self.stats[a].rate)


@dataclass
class RequestSwitch:
    """Turns speculation off for a request whose running tau cannot beat ``cost_ratio``."""

    ema: float = 0.8
    off_steps: int = 16
    tau: dict[int, float] = field(default_factory=dict)
    off_until: dict[int, int] = field(default_factory=dict)

    def observe(self, st: RequestState, tokens_emitted: int, step: int, cost_ratio: float) -> None:
        t = self.tau.get(st.rid, float(tokens_emitted))
        t = self.ema * t + (1 - self.ema) * tokens_emitted
        self.tau[st.rid] = t
        if t < cost_ratio:
            st.speculate = False
            self.off_until[st.rid] = step + self.off_steps

    def maybe_probe(self, st: RequestState, step: int) -> None:
        if not st.speculate and step >= self.off_until.get(st.rid, 0):
            st.speculate = True
            self.tau.pop(st.rid, None)
