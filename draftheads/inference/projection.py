"""Vocabulary projections of a few rows, the engine's most expensive small product.

``x @ weight.T`` for a handful of rows (a tree's frontier, a batch's verified nodes) against a
vocabulary-sized weight runs 2-4x slower through CPU BLAS's row-major GEMM than the same product
taken weight-major, ``(weight @ x.T).T`` (fp32, 2 threads, weight 49,152 x 576: 2 rows 32 vs 10 ms,
5 rows 39 vs 13 ms, 64 rows 81 vs 48 ms; ``python scripts/bench_projection.py`` measures it).

One fp32 row is the exception: BLAS takes it as a matrix-vector product, which ran 3.5x slower than
the same row projected twice as a two-column product (10.0 against 2.9 ms), so a single fp32 row is
projected as two. In bf16 one row is faster alone (4.7 against 5.9 ms).
"""

from __future__ import annotations

import torch


def vocab_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., H] @ weight [V, H].T -> [..., V]."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] == 1 and flat.dtype == torch.float32 and flat.device.type == "cpu":
        return (weight @ flat.repeat(2, 1).T)[:, :1].T.reshape(*x.shape[:-1], weight.shape[0])
    return (weight @ flat.T).T.reshape(*x.shape[:-1], weight.shape[0])

