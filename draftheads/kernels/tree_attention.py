"""Paged tree attention (forward) in Triton.

Layers (Liger's layout): ``_paged_tree_attn_kernel`` (``@triton.jit``) -> ``paged_tree_attention_fwd``
(launcher: shapes, grid, asserts) -> ``paged_tree_attention_triton`` (the engine's entry, taking a
:class:`~draftheads.inference.attention.PagedStep`). ``paged_tree_attention_ref`` is the torch
reference with the launcher's arguments.

Work split. A *tile* is up to ``tokens_per_tile`` consecutive query tokens of one row; one program runs
one (tile, KV head, context split) and holds the tile's tokens x the ``G = heads / kv_heads`` query
heads that share the KV head as one ``[BLOCK_M, head_dim]`` block (row ``m`` is token ``m // G``, head
``kv_head * G + m % G``; ``BLOCK_M`` >= 16 so ``tl.dot`` applies). A tree step usually has one tile
per row; a long prefill has several. QK^T and PV are ``tl.dot`` over ``[BLOCK_N]``-key tiles gathered
through the block table (a tile spans several KV blocks when they are smaller than ``BLOCK_N``),
with an online softmax in fp32.

Visibility. Query token ``i`` of a row with prefix length ``P`` sees the row's positions below its
``limit``; within the tree tail (positions >= ``P``) a tree token sees tail key ``j`` only where bit
``j`` of its ancestor-or-self mask is set. ``anc`` holds that mask as ``W`` int32 words per token
(``[T, W]``, bit ``j % 32`` of word ``j // 32``; any tree size). A chain (prefill, chain drafts) has
every word -1 and ``limit = P + i + 1``, so it is causal at any length without reading the mask; the
kernel tells the two apart by the first word of the row's first token (-1 only for a chain: a tree's
root sees only itself). Key tiles below the tile's *full* bound (``P`` for a tree, the tile's
smallest limit for a chain) are visible to every query row and run with no mask at all; only the
tiles above it apply the limit and, for trees, the ancestor bits.

Context split (flash-decoding). With few programs and a long context, each program covers
``1 / num_splits`` of its tile's key tiles and writes a partial output and log-sum-exp; a second small
kernel, ``_combine_splits_kernel``, merges the splits. :func:`choose_splits` picks the count from the
grid size, the device's SM count and the longest context.

Head sizes that are not a power of two are padded inside the kernel; KV blocks are any power of two.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_tile(K, V, table, kt, kvh, kv_end, stride_kb, stride_ks, stride_kh,
             BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
             MASKED: tl.constexpr):
    """Key tile ``kt`` of a row: K^T [D_PAD, BLOCK_N] and V [BLOCK_N, D_PAD]; with ``MASKED``, keys at
    positions >= ``kv_end`` read as zeros (the row's last tile)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    pos = kt * BLOCK_N + offs_n
    if BLOCK_SIZE >= BLOCK_N:  # the whole tile lies in one KV block
        blk = tl.load(table + (kt * BLOCK_N) // BLOCK_SIZE).to(tl.int64)
        slot = blk * stride_kb + ((kt * BLOCK_N) % BLOCK_SIZE + offs_n) * stride_ks
    else:  # several KV blocks per tile: one block id per key
        if MASKED:
            blk = tl.load(table + pos // BLOCK_SIZE, mask=pos < kv_end, other=0).to(tl.int64)
        else:
            blk = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
        slot = blk * stride_kb + (pos % BLOCK_SIZE) * stride_ks
    slot += kvh * stride_kh
    k_ptr = K + slot[None, :] + offs_d[:, None]
    v_ptr = V + slot[:, None] + offs_d[None, :]
    if MASKED:
        n_ok = pos < kv_end
        d_ok = offs_d < HEAD_DIM
        k_t = tl.load(k_ptr, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        v = tl.load(v_ptr, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    elif HEAD_DIM == D_PAD:
        k_t = tl.load(k_ptr)
        v = tl.load(v_ptr)
    else:
        d_ok = offs_d < HEAD_DIM
        k_t = tl.load(k_ptr, mask=d_ok[:, None], other=0.0)
        v = tl.load(v_ptr, mask=d_ok[None, :], other=0.0)
    return k_t, v


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc, Q, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    """Fold one key tile into the online softmax: scores ``s`` [BLOCK_M, BLOCK_N] (base 2, -inf where a key
    is hidden), values ``v`` [BLOCK_N, D_PAD] -> the new (m_i, l_i, acc). A row with nothing visible yet
    keeps l_i and acc at zero. P is rounded to Q's dtype before the PV dot (on fp32 copies with DOT_F32)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    dot_ty = tl.float32 if DOT_F32 else Q.dtype.element_ty
    acc = acc * alpha[:, None] + tl.dot(p.to(Q.dtype.element_ty).to(dot_ty), v.to(dot_ty), input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_tree_attn_kernel(
    Q, K, V, OUT,  # Q/OUT [T, H, D]; K/V [num_blocks, block_size, KVH, D]
    PART_O, PART_LSE,  # [S, T, H, D] fp32, [S, T, H] fp32 (base-2 log-sum-exp); unused when NUM_SPLITS == 1
    TILES,  # [n_tiles, 4] int32: row, row's first token, tile's first token, tile's token count
    ANC, LIMIT, PREFIX, BLOCK_TABLE,  # ANC [T, W] int32 ancestor-or-self bits; LIMIT [T]; PREFIX [R]; [R, max_blocks]
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_at, stride_bt,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,  # run the dots on fp32 copies of 16-bit operands (the interpreter's bf16 dot is wrong)
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(TILES + 4 * tile)
    row_first = tl.load(TILES + 4 * tile + 1)
    tok0 = tl.load(TILES + 4 * tile + 2)
    ntok = tl.load(TILES + 4 * tile + 3)
    is_tree = tl.load(ANC + row_first * stride_at) != -1
    prefix = tl.load(PREFIX + row)
    table = BLOCK_TABLE + row * stride_bt

    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m // GROUP < ntok  # padding rows (past the tile's tokens) stay masked
    tok = tok0 + tl.where(m_ok, offs_m // GROUP, 0)
    head = kvh * GROUP + offs_m % GROUP
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    lim = tl.load(LIMIT + tok, mask=m_ok, other=0)  # keys at positions >= lim are never visible
    kv_end = tl.max(lim, axis=0)
    full_end = tl.where(is_tree, prefix, tl.min(tl.where(m_ok, lim, kv_end), axis=0))
    q = tl.load(Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    dot_ty = tl.float32 if DOT_F32 else Q.dtype.element_ty
    q = q.to(dot_ty)

    n_kt = tl.cdiv(kv_end, BLOCK_N)
    per_split = tl.cdiv(n_kt, NUM_SPLITS)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, n_kt)
    n_full = full_end // BLOCK_N  # key tiles [0, n_full) are visible to every query row of the tile

    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for kt in range(lo, tl.minimum(hi, n_full)):
        k, v = _kv_tile(K, V, table, kt, kvh, kv_end, stride_kb, stride_ks, stride_kh,
                        BLOCK_N, BLOCK_SIZE, HEAD_DIM, D_PAD, False)
        s = tl.dot(q, k.to(dot_ty), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, Q, DOT_F32, PRECISION)
    for kt in range(tl.maximum(lo, n_full), hi):
        k, v = _kv_tile(K, V, table, kt, kvh, kv_end, stride_kb, stride_ks, stride_kh,
                        BLOCK_N, BLOCK_SIZE, HEAD_DIM, D_PAD, True)
        s = tl.dot(q, k.to(dot_ty), input_precision=PRECISION) * qk_scale
        pos = kt * BLOCK_N + tl.arange(0, BLOCK_N)
        visible = pos[None, :] < lim[:, None]
        if is_tree:  # tail keys: bit (pos - prefix) of the query token's ancestor words
            j = pos - prefix
            jj = tl.maximum(j, 0)
            word = tl.load(ANC + tok[:, None] * stride_at + (jj // 32)[None, :], mask=visible & (j >= 0)[None, :],
                           other=0)
            visible = visible & ((j < 0)[None, :] | (((word >> (jj % 32)[None, :]) & 1) != 0))
        s = tl.where(visible, s, -float("inf"))
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, Q, DOT_F32, PRECISION)

    o_mask = m_ok[:, None] & d_ok[None, :]
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        tl.store(OUT + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=o_mask)
    else:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), -float("inf"))
        tl.store(PART_O + split * stride_ps + tok[:, None] * stride_pt + head[:, None] * stride_ph + offs_d[None, :],
                 out, mask=o_mask)
        tl.store(PART_LSE + split * stride_ls + tok * stride_lt + head, lse, mask=m_ok)


@triton.jit
def _combine_splits_kernel(
    PART_O, PART_LSE, OUT, num_splits,  # [S, T, H, D] fp32, [S, T, H] fp32 -> OUT [T, H, D]
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(PART_LSE + offs_s * stride_ls + t * stride_lt + h, mask=s_ok, other=-float("inf"))
    m = tl.max(lse, axis=0)
    w = tl.where(lse == -float("inf"), 0.0, tl.exp2(lse - tl.where(m == -float("inf"), 0.0, m)))
    o = tl.load(PART_O + offs_s[:, None] * stride_ps + t * stride_pt + h * stride_ph + offs_d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + t * stride_ot + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=d_ok)


MAX_HEAD_DIM = 256
"""Largest head size the kernel takes (padded to a power of two inside)."""

MAX_SPLITS = 32
"""Most context splits of one launch."""

MIN_KEYS_PER_SPLIT = 256
"""A split covers at least this many keys (fewer would spend more on the merge than they save)."""


def supports(head_dim: int, block_size: int) -> bool:
    """Whether the kernel runs with this head size and KV block size (head sizes 1..256, padded to a power of
    two inside; KV blocks any power of two, several per key tile when smaller than the tile)."""
    return 1 <= head_dim <= MAX_HEAD_DIM and block_size >= 1 and block_size & (block_size - 1) == 0


# ---------------------------------------------------------------------------------------------- inputs

@functools.cache
def _byte_weights(device: torch.device) -> torch.Tensor:
    return torch.ones(8, dtype=torch.uint8, device=device) << torch.arange(8, dtype=torch.uint8, device=device)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """[..., 32 * W] bool -> [..., W] int32, bit ``j % 32`` of word ``j // 32``: each 8 bits sum to a byte,
    and 4 bytes read as one int32 (little-endian, as on every device torch runs on)."""
    nbytes = bits.shape[-1] // 8
    packed = (bits.reshape(*bits.shape[:-1], nbytes, 8) * _byte_weights(bits.device)).sum(-1, dtype=torch.uint8)
    return packed.contiguous().view(torch.int32)


def ancestor_words(tree_masks: list[torch.Tensor], prefix_lens: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query token (rows' tokens in order), its ancestor-or-self set as int32 bit words ``[T, W]`` with
    ``W = ceil(longest row / 32)`` (every word -1 for a chain: causal, any length), and the position below
    which its keys lie ``[T]`` int32.

    Runs on the masks' device without reading them back: rows are grouped by query length, and each group
    is packed and checked for being a chain with a few tensor ops.
    """
    q_lens = [m.shape[0] for m in tree_masks]
    total = sum(q_lens)
    words = max(1, -(-max(q_lens, default=1) // 32))
    src = tree_masks[0].device if tree_masks else torch.device(device)
    anc = torch.full((total, words), -1, dtype=torch.int32, device=src)
    limit = torch.empty(total, dtype=torch.int32, device=src)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    groups: dict[int, list[int]] = {}
    for r, n in enumerate(q_lens):
        if n:
            groups.setdefault(n, []).append(r)
    for n, rows in groups.items():
        m = torch.stack([tree_masks[r].to(torch.bool) for r in rows])  # [g, n, n]
        ar = torch.arange(n, device=src)
        causal = ar[None, :] <= ar[:, None]
        chain = (m == causal).flatten(1).all(1)  # [g]
        w = -(-n // 32)
        packed = _pack_bits(torch.nn.functional.pad(m, (0, 32 * w - n)))  # [g, n, w]
        packed = torch.where(chain[:, None, None], torch.full_like(packed, -1), packed)
        prefix = torch.tensor([prefix_lens[r] for r in rows], dtype=torch.int32, device=src)
        lim = prefix[:, None] + torch.where(chain[:, None], (ar + 1).to(torch.int32)[None, :], n)  # [g, n]
        idx = torch.tensor([starts[r] + i for r in rows for i in range(n)], dtype=torch.long, device=src)
        anc[:, :w].index_copy_(0, idx, packed.reshape(-1, w))
        limit.index_copy_(0, idx, lim.reshape(-1).to(torch.int32))
    return anc.to(device), limit.to(device)


@dataclass
class AttentionPlan:
    """Host-side launch plan of one batch layout (shared by every layer of a forward)."""

    tiles: torch.Tensor  # [n_tiles, 4] int32 on the device: row, row's first token, tile's first token, tokens
    tokens_per_tile: int
    """Query tokens per program (``block_m // group``)."""
    block_m: int
    """Query rows per program (tokens x group, padded to a power of two >= 16)."""
    block_n: int
    """Keys per inner iteration."""
    group: int
    """Query heads per KV head."""
    head_dim: int
    max_kv: int
    """Longest key range of any row (prefix + its query tokens)."""


def tile_sizes(max_q: int, group: int, head_dim: int, elem_bytes: int = 2) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for rows of up to ``max_q`` query tokens with ``group`` heads per KV head, operands of
    ``elem_bytes`` each: a query block of at most 32 KiB (128 rows of 128 bf16 values) and key tiles of 64
    keys up to 256 bytes per key row, 32 beyond."""
    row_bytes = max(16, triton.next_power_of_2(head_dim)) * elem_bytes
    block_n = 64 if row_bytes <= 256 else 32
    cap = max(16, min(128, 32768 // row_bytes))
    block_m = max(16, min(triton.next_power_of_2(max(1, max_q) * group), cap), triton.next_power_of_2(group))
    return block_m, block_n


def attention_plan(q_lens: list[int], prefix_lens: list[int], group: int, head_dim: int, device,
                   elem_bytes: int = 2) -> AttentionPlan:
    """Tiles for rows with ``q_lens`` query tokens (stored consecutively, row by row) after ``prefix_lens``,
    queries of ``elem_bytes`` per value."""
    block_m, block_n = tile_sizes(max(q_lens, default=1), group, head_dim, elem_bytes)
    per_tile = block_m // group
    tiles, first = [], 0
    for r, n in enumerate(q_lens):
        tiles.extend((r, first, first + t0, min(per_tile, n - t0)) for t0 in range(0, n, per_tile))
        first += n
    max_kv = max((p + n for p, n in zip(prefix_lens, q_lens)), default=0)
    tiles_t = torch.tensor(tiles, dtype=torch.int32).reshape(-1, 4).to(device)
    return AttentionPlan(tiles_t, per_tile, block_m, block_n, group, head_dim, max_kv)


@functools.cache
def _device_programs(device: torch.device) -> int:
    """Programs that fill the device: 2 per SM on CUDA; 1 elsewhere (the interpreter runs them one by one)."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def choose_splits(programs: int, max_kv: int, device_programs: int) -> int:
    """Context splits for a grid of ``programs`` (tiles x KV heads) over contexts of up to ``max_kv`` keys:
    enough to fill ``device_programs``, each split keeping at least ``MIN_KEYS_PER_SPLIT`` keys."""
    if programs <= 0 or programs >= device_programs:
        return 1
    want = -(-device_programs // programs)
    return max(1, min(want, -(-max_kv // MIN_KEYS_PER_SPLIT), MAX_SPLITS))


def _plan_from_tensors(token_row, prefix_lens, group, head_dim, device, elem_bytes) -> AttentionPlan:
    """A plan for the launcher's tensors alone (reads them back: the engine builds its plan from host lists)."""
    rows = prefix_lens.numel()
    tr = token_row.cpu().long()
    assert bool((tr[1:] >= tr[:-1]).all()), "query tokens must be stored row by row"
    q_lens = torch.bincount(tr, minlength=rows).tolist()
    return attention_plan(q_lens, prefix_lens.cpu().tolist(), group, head_dim, device, elem_bytes)


# ---------------------------------------------------------------------------------------------- launcher


def paged_tree_attention_fwd(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    token_row: torch.Tensor,  # [T] int32, non-decreasing (rows' tokens stored consecutively)
    anc: torch.Tensor,  # [T, W] int32
    limit: torch.Tensor,  # [T] int32
    prefix_lens: torch.Tensor,  # [R] int32
    block_tables: torch.Tensor,  # [R, max_blocks] int32
    scale: float,
    *,
    plan: AttentionPlan | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of every query token over its row's pages -> [T, H, D]. ``plan`` (from
    :func:`attention_plan`) saves reading ``token_row`` back; ``num_splits`` overrides :func:`choose_splits`."""
    t, h, d = q.shape
    nb, bs, kvh, d2 = k_cache.shape
    assert d == d2 and k_cache.shape == v_cache.shape, (q.shape, k_cache.shape, v_cache.shape)
    assert k_cache.stride() == v_cache.stride(), "K and V caches must share one layout"
    assert h % kvh == 0, f"heads {h} must be a multiple of kv heads {kvh}"
    assert supports(d, bs), f"head_dim {d} / KV block size {bs}: see supports()"
    assert token_row.shape == (t,) and limit.shape == (t,), (token_row.shape, limit.shape, t)
    assert anc.dim() == 2 and anc.shape[0] == t and anc.dtype == torch.int32, (anc.shape, anc.dtype)
    assert block_tables.dim() == 2 and block_tables.shape[0] == prefix_lens.numel()
    assert k_cache.stride(-1) == 1
    out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = h // kvh
    if plan is None:
        plan = _plan_from_tensors(token_row, prefix_lens, group, d, q.device, q.element_size())
    assert plan.group == group and plan.head_dim == d, "the plan was made for other head counts"
    n_tiles = plan.tiles.shape[0]
    splits = num_splits or choose_splits(n_tiles * kvh, plan.max_kv, _device_programs(q.device))
    d_pad = max(16, triton.next_power_of_2(d))
    if splits > 1:
        part_o = torch.empty(splits, t, h, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(splits, t, h, dtype=torch.float32, device=q.device)
    else:
        part_o, part_lse = out, out  # not read
    anc = anc.contiguous()
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    _paged_tree_attn_kernel[(n_tiles, kvh, splits)](
        q, k_cache, v_cache, out, part_o, part_lse, plan.tiles, anc, limit, prefix_lens, block_tables,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), anc.stride(0), block_tables.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        GROUP=group, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_SIZE=bs, HEAD_DIM=d, D_PAD=d_pad,
        NUM_SPLITS=splits, PRECISION="ieee" if q.dtype == torch.float32 or interpreted else "tf32",
        DOT_F32=interpreted and q.dtype == torch.bfloat16,
        num_warps=8 if plan.block_m * d_pad > 64 * 128 else 4, num_stages=2,
    )
    if splits > 1:
        _combine_splits_kernel[(t, h)](
            part_o, part_lse, out, splits,
            part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=d, D_PAD=d_pad, S_PAD=triton.next_power_of_2(splits),
        )
    return out


def paged_tree_attention_ref(q, k_cache, v_cache, token_row, anc, limit, prefix_lens, block_tables, scale):
    """Torch reference with the launcher's arguments: gather + dense masked softmax per token."""
    t, h, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    words = anc.shape[1]
    out = torch.empty_like(q)
    for i in range(t):
        r = int(token_row[i])
        pos = torch.arange(int(limit[i]), device=q.device)
        blocks = block_tables[r][pos // bs].long()
        k = k_cache[blocks, pos % bs].float()  # [S, KVH, D]
        v = v_cache[blocks, pos % bs].float()
        j = pos - int(prefix_lens[r])
        jj = j.clamp(min=0)
        word = anc[i][(jj // 32).clamp(max=words - 1)]  # a chain's words are all -1: every bit set
        visible = (j < 0) | (((word >> (jj % 32)) & 1) != 0)
        kk = k.repeat_interleave(h // kvh, 1)  # [S, H, D]
        vv = v.repeat_interleave(h // kvh, 1)
        s = torch.einsum("hd,shd->hs", q[i].float(), kk) * scale
        s = s.masked_fill(~visible[None], float("-inf")).softmax(-1)
        out[i] = torch.einsum("hs,shd->hd", s, vv).to(q.dtype)
    return out


# ---------------------------------------------------------------------------------------------- engine entry


def step_arguments(step, layer: int, q: torch.Tensor):
    """Launcher arguments for one engine step and its queries ``q`` [T, H, D] (built once per forward and
    cached on the step; the plan comes from the step's host lists, so nothing is read back from the device)."""
    cache = step.cache
    device = q.device
    if step._triton_args is None:
        rows = step.rows
        q_lens = [step.query_start[r + 1] - step.query_start[r] for r in range(rows)]
        token_row = torch.repeat_interleave(torch.arange(rows, dtype=torch.int32), torch.tensor(q_lens)).to(device)
        width = max(len(bt) for bt in step.block_tables)
        tables = torch.zeros(rows, width, dtype=torch.int32)
        for r, bt in enumerate(step.block_tables):
            tables[r, : len(bt)] = torch.tensor(bt, dtype=torch.int32)
        anc, limit = ancestor_words(step.tree_masks, step.prefix_lens, device)
        kv_heads, head_dim = cache.k[layer].shape[2], cache.k[layer].shape[3]
        plan = attention_plan(q_lens, step.prefix_lens, q.shape[1] // kv_heads, head_dim, device, q.element_size())
        step._triton_args = (
            token_row, anc, limit, torch.tensor(step.prefix_lens, dtype=torch.int32, device=device), tables.to(device),
            plan,
        )
    return (cache.k[layer], cache.v[layer], *step._triton_args)


def paged_tree_attention_triton(query, step, layer: int, scaling: float) -> torch.Tensor:
    """Engine entry: query [1, H, T, D] -> [T, H, D]."""
    q = query[0].transpose(0, 1)
    k, v, token_row, anc, limit, prefix, tables, plan = step_arguments(step, layer, q)
    return paged_tree_attention_fwd(q, k, v, token_row, anc, limit, prefix, tables, scaling, plan=plan)
