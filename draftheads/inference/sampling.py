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


NUCLEUS_CANDIDATES = 1024
"""top-p first looks for its nucleus among this many most likely tokens; only a flatter distribution, whose
nucleus lies beyond them, takes the full sort of the vocabulary (49,152 entries for SmolLM2)."""


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> float32 probabilities after temperature, top-k and top-p."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return nucleus(probs, params.top_p) if params.top_p < 1 else probs


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens until their mass reaches ``top_p`` (a token is kept while the mass
    strictly before it is below ``top_p``), renormalised. Each row looks among its ``NUCLEUS_CANDIDATES``
    most likely tokens, and sorts its whole vocabulary only when its nucleus reaches past them."""
    shape = probs.shape
    probs = probs.reshape(-1, shape[-1])

    def kept(top: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        top = top.masked_fill(top.cumsum(-1) - top >= top_p, 0.0)
        mass = torch.stack([row.sum() for row in top])  # row by row: a row's result never depends on its batch
        return torch.zeros_like(probs[: len(top)]).scatter_(-1, idx, top / mass[:, None])

    top, idx = torch.topk(probs, min(NUCLEUS_CANDIDATES, shape[-1]), dim=-1)  # most likely first
    out = kept(top, idx)
    if top.shape[-1] < shape[-1]:
        short = (top.sum(-1) < top_p).nonzero().flatten()  # rows whose nucleus reaches past the candidates
        if len(short):
            out[short] = kept(*torch.sort(probs[short], dim=-1, descending=True))
    return out.reshape(shape)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor | float) -> torch.Tensor:
    """The token of each row of ``probs`` [..., V] whose cumulative probability interval holds ``u`` [...]
    (in [0, 1)): a token of zero probability is never picked. Every draw from a distribution in the engine
    is this with one :func:`uniform` of the request's generator."""
    u = torch.as_tensor(u, dtype=torch.float64, device=probs.device)
    c = torch.cumsum(probs.double(), -1)
    picked = torch.searchsorted(c, (u * c[..., -1]).unsqueeze(-1), right=True).squeeze(-1)
    return picked.clamp(max=probs.shape[-1] - 1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from ``probs`` [V] by :func:`inverse_cdf` of one uniform of ``generator``."""
    return int(inverse_cdf(probs, uniform(generator)))


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
    """One token per row of ``logits`` [R, V]: the argmax when the row's params are greedy, else a draw
    under them with one uniform from its generator; read back to the host in one go. Rows that share
    their sampling settings are computed together."""
    picks = torch.empty(len(params), dtype=torch.long, device=logits.device)
    groups: dict[tuple, list[int]] = {}
    for r, p in enumerate(params):
        groups.setdefault(None if p.greedy else (p.temperature, p.top_k, p.top_p), []).append(r)
    for key, rows in groups.items():
        index = torch.tensor(rows, device=logits.device)
        if key is None:
            picks[index] = logits[index].argmax(-1)
            continue
        u = torch.tensor([uniform(generators[r]) for r in rows], dtype=torch.float64, device=logits.device)
        picks[index] = inverse_cdf(target_probs(logits[index], params[rows[0]]), u)
    return picks.tolist()


def request_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A request's random stream, seeded, on the device its probabilities live on (its uniforms are drawn
    there, beside the probabilities they pick from)."""
    return torch.Generator(device=device).manual_seed(seed)


def uniform(generator: torch.Generator | None) -> float:
    """One U[0, 1) draw (float64) from ``generator``, on its device."""
    device = generator.device if generator is not None else None
    return float(torch.rand((), generator=generator, dtype=torch.float64, device=device))

