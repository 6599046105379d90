"""Vocabulary projections of a few rows, the engine's most expensive small product.

``x @ weight.T`` for a handful of rows (a tree's frontier, a batch's verified nodes) against a
vocabulary-sized weight runs 2-4x slower through CPU BLAS's row-major GEMM than the same product
taken weight-major, ``(weight @ x.T).T`` (fp32, 2 threads, weight 49,152 x 576: 2 rows 32 vs 10 ms,
5 rows 39 vs 13 ms, 64 rows 81 vs 48 ms; ``python scripts/bench_projection.py`` measures it).
"""

from __future__ import annotations

import torch


def vocab_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., H] @ weight [V, H].T -> [..., V]."""
    flat = x.reshape(-1, x.shape[-1])
    return (weight @ flat.T).T.reshape(*x.shape[:-1], weight.shape[0])

