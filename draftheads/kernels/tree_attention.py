"""Paged tree attention (forward) in Triton.

Layers (Liger's layout): ``_paged_tree_attn_kernel`` (``@triton.jit``) -> ``paged_tree_attention_fwd``
(launcher: shapes, grid, asserts) -> ``paged_tree_attention_triton`` (the engine's entry, taking a
:class:`~draftheads.inference.attention.PagedStep`). ``paged_tree_attention_ref`` is the torch
reference with the same arguments.

Every query token is one program per head. Its keys are the row's positions below its ``limit`` in
the paged cache (the tree's own K/V were written there before attention): all prefix positions are
visible, tree position j only when bit j of the token's ancestor mask is set (``anc`` holds two int64
words: trees of up to 128 tokens). A chain (prefill, chain drafts) is causal instead: both words -1
and ``limit`` = prefix + its index + 1, so prompts of any length run here. Head sizes that are not a
power of two are padded inside the kernel. Online softmax over key blocks, so no
``[tokens, context]`` score matrix is materialised. GQA: query head h reads kv head
``h // (heads / kv_heads)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_tree_attn_kernel(
    Q, K, V, OUT,  # Q/OUT [T, H, D]; K/V [num_blocks, block_size, KVH, D]
    TOKEN_ROW, ANC, LIMIT,  # [T] row of each query token; ANC [T, 2] int64 ancestor-or-self bits; LIMIT [T]
    PREFIX, BLOCK_TABLE,  # [R], [R, max_blocks]
    scale, head_dim,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    row = tl.load(TOKEN_ROW + t)
    prefix = tl.load(PREFIX + row)
    limit = tl.load(LIMIT + t)  # keys at positions >= limit are never visible
    anc_lo = tl.load(ANC + 2 * t)
    anc_hi = tl.load(ANC + 2 * t + 1)
    causal = (anc_lo == -1) & (anc_hi == -1)  # a chain (e.g. prefill): every key below the limit
    offs_d = tl.arange(0, HEAD_DIM)  # head_dim padded to a power of two
    d_ok = offs_d < head_dim
    offs_n = tl.arange(0, BLOCK_SIZE)
    q = tl.load(Q + t * stride_qt + h * stride_qh + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    n_blocks = tl.cdiv(limit, BLOCK_SIZE)
    for b in range(0, n_blocks):
        block = tl.load(BLOCK_TABLE + row * stride_bt + b)
        pos = b * BLOCK_SIZE + offs_n
        kv_off = block * stride_kb + offs_n[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :]
        k = tl.load(K + kv_off, mask=d_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_SIZE, D]
        v = tl.load(V + kv_off, mask=d_ok[None, :], other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale  # [BLOCK_SIZE]
        j = pos - prefix  # index in the tree (negative: prefix)
        j_lo = tl.where((j >= 0) & (j < 64), j, 0).to(tl.int64)
        j_hi = tl.where((j >= 64) & (j < 128), j - 64, 0).to(tl.int64)
        bit = tl.where(j < 64, (anc_lo >> j_lo) & 1, (anc_hi >> j_hi) & 1)
        visible = (pos < limit) & ((j < 0) | causal | ((j < 128) & (bit != 0)))
        s = tl.where(visible, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        p = tl.where(visible, p, 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(OUT + t * stride_ot + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=d_ok)


MAX_TREE_BITS = 128
"""Ancestor bits per query token: trees (not chains) of up to this many tokens."""


def supports(head_dim: int, block_size: int) -> bool:
    """Whether the kernel runs with this head size and KV block size (any head size up to 256; KV blocks
    a power of two)."""
    return 1 <= head_dim <= 256 and block_size >= 1 and block_size & (block_size - 1) == 0


def is_chain(mask: torch.Tensor) -> bool:
    """A [q, q] ancestor mask that is causal (every token sees every earlier one): a chain, e.g. prefill."""
    q = mask.shape[0]
    return int(mask.sum()) == q * (q + 1) // 2 and bool(mask.tril().sum() == mask.sum())


def ancestor_words(tree_masks: list[torch.Tensor], prefix_lens: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query token, its ancestor-or-self set as two int64 bit words [T, 2] (both -1 for a chain:
    causal, any length), and the position below which its keys lie [T] int32."""
    words, limits = [], []
    weights = torch.ones(64, dtype=torch.int64) << torch.arange(64, dtype=torch.int64)
    for m, prefix in zip(tree_masks, prefix_lens):
        q = m.shape[0]
        m = m.cpu()
        if is_chain(m):
            words.append(torch.full((q, 2), -1, dtype=torch.int64))
            limits.append(prefix + 1 + torch.arange(q, dtype=torch.int32))
            continue
        if q > MAX_TREE_BITS:
            raise ValueError(f"tree of {q} tokens: the Triton kernel supports trees of at most {MAX_TREE_BITS} "
                             "(chains of any length)")
        bits = torch.zeros(q, 128, dtype=torch.int64)
        bits[:, :q] = m.to(torch.int64)
        lo = (bits[:, :64] * weights).sum(1)  # int64 wraps for bit 63, as intended
        hi = (bits[:, 64:] * weights).sum(1)
        words.append(torch.stack([lo, hi], 1))
        limits.append(torch.full((q,), prefix + q, dtype=torch.int32))
    return torch.cat(words).to(device), torch.cat(limits).to(device)


def paged_tree_attention_fwd(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    token_row: torch.Tensor,  # [T] int32
    anc: torch.Tensor,  # [T, 2] int64
    limit: torch.Tensor,  # [T] int32
    prefix_lens: torch.Tensor,  # [R] int32
    block_tables: torch.Tensor,  # [R, max_blocks] int32
    scale: float,
) -> torch.Tensor:
    t, h, d = q.shape
    nb, bs, kvh, d2 = k_cache.shape
    assert d == d2 and k_cache.shape == v_cache.shape, (q.shape, k_cache.shape, v_cache.shape)
    assert h % kvh == 0, f"heads {h} must be a multiple of kv heads {kvh}"
    assert supports(d, bs), f"head_dim {d} / KV block size {bs}: see supports()"
    assert token_row.shape == (t,) and anc.shape == (t, 2) and anc.dtype == torch.int64 and limit.shape == (t,)
    assert k_cache.stride(-1) == 1 and q.stride(-1) == 1
    q = q.contiguous()
    out = torch.empty_like(q)
    _paged_tree_attn_kernel[(t, h)](
        q, k_cache, v_cache, out, token_row, anc, limit,
        prefix_lens, block_tables, scale, d,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=h // kvh, BLOCK_SIZE=bs, HEAD_DIM=triton.next_power_of_2(d),
    )
    return out


def paged_tree_attention_ref(q, k_cache, v_cache, token_row, anc, limit, prefix_lens, block_tables, scale):
    """Torch reference with the launcher's arguments: gather + dense masked softmax per token."""
    t, h, d = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for i in range(t):
        r = int(token_row[i])
        pos = torch.arange(int(limit[i]), device=q.device)
        blocks = block_tables[r][pos // bs].long()
        k = k_cache[blocks, pos % bs].float()  # [S, KVH, D]
        v = v_cache[blocks, pos % bs].float()
        j = pos - int(prefix_lens[r])
        if int(anc[i, 0]) == -1 and int(anc[i, 1]) == -1:
            visible = torch.ones_like(j, dtype=torch.bool)
        else:
            word = torch.where(j < 64, anc[i, 0], anc[i, 1])
            bit = (word >> torch.where(j < 64, j, j - 64).clamp(min=0)) & 1
            visible = (j < 0) | (bit != 0)
        kk = k.repeat_interleave(h // kvh, 1)  # [S, H, D]
        vv = v.repeat_interleave(h // kvh, 1)
        s = torch.einsum("hd,shd->hs", q[i].float(), kk) * scale
        s = s.masked_fill(~visible[None], float("-inf")).softmax(-1)
        out[i] = torch.einsum("hs,shd->hd", s, vv).to(q.dtype)
    return out


def step_arguments(step, layer: int, device):
    """Launcher arguments for one engine step (built once per forward and cached on the step)."""
    cache = step.cache
    if step._triton_args is None:
        rows = step.rows
        q_lens = [step.query_start[r + 1] - step.query_start[r] for r in range(rows)]
        token_row = torch.repeat_interleave(torch.arange(rows, dtype=torch.int32), torch.tensor(q_lens)).to(device)
        width = max(len(bt) for bt in step.block_tables)
        tables = torch.zeros(rows, width, dtype=torch.int32)
        for r, bt in enumerate(step.block_tables):
            tables[r, : len(bt)] = torch.tensor(bt, dtype=torch.int32)
        anc, limit = ancestor_words(step.tree_masks, step.prefix_lens, device)
        step._triton_args = (
            token_row, anc, limit, torch.tensor(step.prefix_lens, dtype=torch.int32, device=device), tables.to(device),
        )
    return (cache.k[layer], cache.v[layer], *step._triton_args)


def paged_tree_attention_triton(query, step, layer: int, scaling: float) -> torch.Tensor:
    """Engine entry: query [1, H, T, D] -> [T, H, D]."""
    q = query[0].transpose(0, 1)
    k, v, token_row, anc, limit, prefix, tables = step_arguments(step, layer, q.device)
    return paged_tree_attention_fwd(q, k, v, token_row, anc, limit, prefix, tables, scaling)
