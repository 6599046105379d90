"""The greedy token of each hidden state under a vocabulary-sized weight, one chunk of logits at a time.

Shared by training (a head's top-1 accuracy, the target's argmax in the feature cache) and data generation
(the target's argmax captured beside the hidden states). Plain torch, with no Triton launcher: the
reference is the whole product, ``(h @ w.T).argmax(-1)``.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def linear_argmax(h: torch.Tensor, w: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """argmax of ``h @ w.T`` over the vocabulary, ``chunk_size`` rows at a time: h [N, H], w [V, H] -> [N] int64."""
    out = torch.empty(h.shape[0], dtype=torch.int64, device=h.device)
    for s in range(0, h.shape[0], chunk_size):
        out[s : s + chunk_size] = (h[s : s + chunk_size] @ w.T).argmax(-1)
    return out
