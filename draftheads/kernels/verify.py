"""Tree verification and KV commit in Triton, fused over the batch.

* ``greedy_verify``: one program per row walks its tree from the root, following the child whose
  token equals the target's argmax at the current node; outputs the accepted node indices and
  their count (same result as :func:`draftheads.inference.verify.verify_greedy`).
* ``sampled_verify``: the sampling walk for deterministic drafts with given uniforms (same result as
  :func:`draftheads.inference.verify.verify_sampled_uniforms`).
* ``commit_kv_layers``: copies every accepted node's K/V (all rows, all layers) from its tree slot to
  its final slot in one launch (each row's moves in order, so overlapping source/destination ranges are
  safe).

Each launcher checks shapes and sets the grid; ``*_ref`` are the torch references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _load_tree(TOKENS, PARENTS, SIZES, row, stride_row, MAX_NODES: tl.constexpr):
    """One row's padded tree: (node offsets, valid mask, tokens, parents)."""
    offs = tl.arange(0, MAX_NODES)
    valid = offs < tl.load(SIZES + row)
    tokens = tl.load(TOKENS + row * stride_row + offs, mask=valid, other=-1)
    parents = tl.load(PARENTS + row * stride_row + offs, mask=valid, other=-2)
    return offs, valid, tokens, parents


@triton.jit
def _greedy_verify_kernel(TOKENS, PARENTS, ARGMAX, SIZES, OUT, COUNT, stride_row, MAX_NODES: tl.constexpr):
    row = tl.program_id(0)
    offs, valid, tokens, parents = _load_tree(TOKENS, PARENTS, SIZES, row, stride_row, MAX_NODES)
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


@triton.jit
def _sampled_verify_kernel(TOKENS, PARENTS, PROBS, STARTS, SIZES, UNIF, OUT, COUNT, BONUS, stride_row, stride_p, V,
                           MAX_NODES: tl.constexpr, BLOCK_V: tl.constexpr):
    """Per row: at each node draw x by inverse CDF of the target's probabilities with the depth's
    uniform; follow the child carrying x, else x is the bonus token."""
    row = tl.program_id(0)
    start = tl.load(STARTS + row)
    offs, valid, tokens, parents = _load_tree(TOKENS, PARENTS, SIZES, row, stride_row, MAX_NODES)
    cur = 0
    count = 0
    go = 1
    bonus = 0
    for d in range(0, MAX_NODES):
        u = tl.load(UNIF + row * stride_row + d)
        base = PROBS + (start + cur) * stride_p
        total = 0.0
        for b in range(0, V, BLOCK_V):
            ov = b + tl.arange(0, BLOCK_V)
            total += tl.sum(tl.load(base + ov, mask=ov < V, other=0.0).to(tl.float32), axis=0)
        target = u * total
        carried = 0.0
        x = V - 1
        for b in range(0, V, BLOCK_V):
            ov = b + tl.arange(0, BLOCK_V)
            pv = tl.load(base + ov, mask=ov < V, other=0.0).to(tl.float32)
            c = tl.cumsum(pv, axis=0) + carried
            hit = (c > target) & (ov < V)
            first = tl.min(tl.where(hit, ov, V), axis=0)
            x = tl.minimum(x, first)
            carried += tl.sum(pv, axis=0)
        match = valid & (parents == cur) & (tokens == x) & (go == 1)
        child = tl.min(tl.where(match, offs, MAX_NODES), axis=0)
        found = child < MAX_NODES
        bonus = tl.where((go == 1) & (found == 0), x, bonus)
        tl.store(OUT + row * stride_row + count, child, mask=found)
        count = tl.where(found, count + 1, count)
        go = tl.where(found, go, 0)
        cur = tl.where(found, child, cur)
    tl.store(COUNT + row, count)
    tl.store(BONUS + row, bonus)


def sampled_verify(tokens, parents, probs, starts, sizes, uniforms):
    """tokens/parents [rows, W] int32; probs [total_nodes, V] (rows' nodes stacked, row r from starts[r]);
    uniforms [rows, W] float32 (one per depth) -> (accepted [rows, W], count [rows], bonus [rows])."""
    rows, width = tokens.shape
    block = triton.next_power_of_2(width)
    pad = block - width
    if pad:
        tokens = torch.nn.functional.pad(tokens, (0, pad), value=-1)
        parents = torch.nn.functional.pad(parents, (0, pad), value=-2)
        uniforms = torch.nn.functional.pad(uniforms, (0, pad), value=0.5)
    tokens, parents, uniforms, probs = tokens.contiguous(), parents.contiguous(), uniforms.contiguous(), probs.contiguous()
    out = torch.full((rows, block), -1, dtype=torch.int32, device=tokens.device)
    count = torch.zeros(rows, dtype=torch.int32, device=tokens.device)
    bonus = torch.zeros(rows, dtype=torch.int32, device=tokens.device)
    v = probs.shape[1]
    _sampled_verify_kernel[(rows,)](tokens, parents, probs, starts, sizes, uniforms, out, count, bonus,
                                    tokens.stride(0), probs.stride(0), v, MAX_NODES=block,
                                    BLOCK_V=min(1024, triton.next_power_of_2(v)))
    return out[:, :width], count, bonus


@triton.jit
def _commit_kv_kernel(KV, SRC, DST, ROW_START, stride_layer, stride_half, ROW: tl.constexpr, BLOCK: tl.constexpr):
    # one program per (layer and K/V half, batch row, chunk of a slot's elements). A row's moves run in
    # order inside its program, and each element of a slot is read and written by the same lane: move d
    # goes to a position below every later move's source (dst_d = length + d < length + accepted[e] for
    # e > d), so a source is read before any move overwrites it. Rows touch disjoint slots.
    lh = tl.program_id(0)
    row = tl.program_id(1)
    chunk = tl.program_id(2)
    base = KV + (lh // 2).to(tl.int64) * stride_layer + (lh % 2).to(tl.int64) * stride_half
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    m = offs < ROW
    for i in range(tl.load(ROW_START + row), tl.load(ROW_START + row + 1)):
        src = tl.load(SRC + i)
        dst = tl.load(DST + i)
        x = tl.load(base + src * ROW + offs, mask=m)
        tl.store(base + dst * ROW + offs, x, mask=m)


def commit_kv_layers(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, row_start: torch.Tensor) -> None:
    """kv [layers, 2, slots, kv_heads, head_dim] (contiguous): for every layer, K and V, copy slots ``src[i]``
    -> ``dst[i]`` (int64 [n]) in one launch. ``row_start`` [rows + 1] (int64) splits the moves into batch rows.

    Within a row, moves run in order and each move's destination must lie below every later move's source
    (accepted nodes move towards the root: destinations ``length + d``, sources ``length + accepted[d]``,
    both increasing), so no source is overwritten before it is read. Different rows must touch disjoint slots.
    """
    assert kv.dim() == 5 and kv.shape[1] == 2 and kv.is_contiguous(), (kv.shape, kv.stride())
    assert src.shape == dst.shape and src.dim() == 1, (src.shape, dst.shape)
    assert row_start.dim() == 1 and row_start.numel() >= 1, row_start.shape
    rows = row_start.numel() - 1
    if src.numel() == 0 or rows == 0:
        return
    row = kv.shape[3] * kv.shape[4]
    block = min(1024, triton.next_power_of_2(row))
    _commit_kv_kernel[(2 * kv.shape[0], rows, triton.cdiv(row, block))](
        kv, src, dst, row_start, kv.stride(0), kv.stride(1), ROW=row, BLOCK=block,
    )


def commit_kv_layers_ref(kv, src, dst, row_start=None) -> None:
    """Gather every source, then scatter (the same result as the in-order moves under their precondition)."""
    kv.index_copy_(2, dst, torch.index_select(kv, 2, src))

