"""Sampling parameters and the target's token distribution under them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from draftheads.errors import DraftheadsError


@dataclass
class SamplingParams:
    temperature: float = 0.0
    """0 = greedy (token-identical to plain greedy decoding)."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = all)."""
    max_new_tokens: int = 128
    seed: int = 0
    stop_at_eos: bool = True

    def __post_init__(self):
        if not math.isfinite(self.temperature) or not math.isfinite(self.top_p):
            raise DraftheadsError(f"temperature {self.temperature} and top_p {self.top_p} must be finite numbers")
        if self.temperature < 0:
            raise DraftheadsError(f"temperature {self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise DraftheadsError(f"top_p {self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise DraftheadsError(f"top_k {self.top_k} must be >= 0 (0 = no limit)")
        if self.max_new_tokens < 1:
            raise DraftheadsError(f"max_new_tokens {self.max_new_tokens} must be >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> float32 probabilities after temperature, top-k and top-p."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, -1) - sorted_p  # mass strictly before each token
        sorted_p = sorted_p.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
    """One token per row of ``logits`` [R, V]: the argmax when the row's params are greedy, else a draw
    under them from its generator; read back to the host in one go."""
    picks = [logits[r].argmax(-1, keepdim=True) if p.greedy else
             torch.multinomial(target_probs(logits[r], p), 1, generator=g) for r, (p, g) in enumerate(zip(params, generators))]
    return torch.cat(picks).tolist() if picks else []



def request_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A request's random stream, seeded, on the device its probabilities live on (``torch.multinomial``
    on CUDA probabilities needs a CUDA generator)."""
    return torch.Generator(device=device).manual_seed(seed)


def uniform(generator: torch.Generator | None) -> float:
    """One U[0, 1) draw (float64) from ``generator``, on its device."""
    device = generator.device if generator is not None else None
    return float(torch.rand((), generator=generator, dtype=torch.float64, device=device))

