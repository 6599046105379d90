"""Tree verification and KV commit in Triton, fused over the batch.

* ``greedy_verify``: one program per row walks its tree from the root, following the child whose
  token equals the target's argmax at the current node; outputs the accepted node indices and
  their count (same result as :func:`draftheads.inference.verify.verify_greedy`).
* ``commit_kv``: copies every accepted node's K/V (all rows, one layer) from its tree slot to its
  final slot in one launch (moves in order, so overlapping source/destination ranges are safe).

Each launcher checks shapes and sets the grid; ``*_ref`` are the torch references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _greedy_verify_kernel(TOKENS, PARENTS, ARGMAX, SIZES, OUT, COUNT, stride_row, MAX_NODES: tl.constexpr):
    row = tl.program_id(0)
    n = tl.load(SIZES + row)
    offs = tl.arange(0, MAX_NODES)
    valid = offs < n
    tokens = tl.load(TOKENS + row * stride_row + offs, mask=valid, other=-1)
    parents = tl.load(PARENTS + row * stride_row + offs, mask=valid, other=-2)
    cur = 0
    count = 0
    go = 1
    for _d in range(0, MAX_NODES):
        want = tl.load(ARGMAX + row * stride_row + cur)
        match = valid & (parents == cur) & (tokens == want) & (go == 1)
        # the first matching child (lowest index), or MAX_NODES when none
        child = tl.min(tl.where(match, offs, MAX_NODES), axis=0)
        found = child < MAX_NODES
        tl.store(OUT + row * stride_row + count, child, mask=found)
        count = tl.where(found, count + 1, count)
        go = tl.where(found, go, 0)
        cur = tl.where(found, child, cur)
    tl.store(COUNT + row, count)


def greedy_verify(tokens: torch.Tensor, parents: torch.Tensor, argmax: torch.Tensor, sizes: torch.Tensor):
    """tokens/parents/argmax [rows, max_nodes] int32 (padded), sizes [rows] -> (accepted [rows, max_nodes], count [rows])."""
    rows, width = tokens.shape
    assert parents.shape == argmax.shape == (rows, width) and sizes.shape == (rows,)
    block = triton.next_power_of_2(width)
    pad = block - width
    if pad:
        tokens = torch.nn.functional.pad(tokens, (0, pad), value=-1)
        parents = torch.nn.functional.pad(parents, (0, pad), value=-2)
        argmax = torch.nn.functional.pad(argmax, (0, pad), value=-1)
    tokens, parents, argmax = tokens.contiguous(), parents.contiguous(), argmax.contiguous()
    out = torch.full((rows, block), -1, dtype=torch.int32, device=tokens.device)
    count = torch.zeros(rows, dtype=torch.int32, device=tokens.device)
    _greedy_verify_kernel[(rows,)](tokens, parents, argmax, sizes, out, count, tokens.stride(0), MAX_NODES=block)
    return out[:, :width], count


def greedy_verify_ref(tokens, parents, argmax, sizes):
    rows, width = tokens.shape
    out = torch.full((rows, width), -1, dtype=torch.int32)
    count = torch.zeros(rows, dtype=torch.int32)
    for r in range(rows):
        n = int(sizes[r])
        cur, k = 0, 0
        while True:
            kids = [c for c in range(1, n) if int(parents[r, c]) == cur and int(tokens[r, c]) == int(argmax[r, cur])]
            if not kids:
                break
            out[r, k] = kids[0]
            k += 1
            cur = kids[0]
        count[r] = k
    return out, count


@triton.jit
def _commit_kv_kernel(KV, SRC, DST, n_moves, stride_half, ROW: tl.constexpr, BLOCK: tl.constexpr):
    # moves run in order inside one program: a node moves towards the root (dst <= src), so a slot is
    # read before any later move overwrites it; programs split only the K and V halves
    half = tl.program_id(0)
    for i in range(0, n_moves):
        src = tl.load(SRC + i)
        dst = tl.load(DST + i)
        for start in range(0, ROW, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < ROW
            x = tl.load(KV + half * stride_half + src * ROW + offs, mask=m)
            tl.store(KV + half * stride_half + dst * ROW + offs, x, mask=m)


def commit_kv(kv_flat: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """kv_flat [2, slots, kv_heads, head_dim]: copy slots ``src`` -> ``dst`` (int64 [n]) for K and V in one launch.

    Sources must not be overwritten before they are read: accepted nodes move towards the root
    (dst <= src, both increasing), which the engine guarantees.
    """
    assert kv_flat.dim() == 4 and kv_flat.shape[0] == 2 and kv_flat.is_contiguous()
    assert src.shape == dst.shape and src.dim() == 1
    if src.numel() == 0:
        return
    row = kv_flat.shape[2] * kv_flat.shape[3]
    _commit_kv_kernel[(2,)](kv_flat, src, dst, src.numel(), kv_flat.stride(0), ROW=row,
                             BLOCK=min(1024, triton.next_power_of_2(row)))


def commit_kv_ref(kv_flat, src, dst) -> None:
    kv_flat.index_copy_(1, dst, torch.index_select(kv_flat, 1, src))
