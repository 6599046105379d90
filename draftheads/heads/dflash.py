"""DFlash: a block drafter that writes all ``block_size - 1`` draft tokens of a step in one forward.

A block at position P is ``[x_P, MASK, ..., MASK]`` at positions P .. P + block_size - 1, where x_P is
the last token the target emitted (it has no target hidden state yet). The mask at P + k predicts the
token at P + k itself (no shift), so one block drafts ``block_size - 1`` tokens.

The target's context enters as keys and values, not as input tokens ("KV injection"): the hidden states
of ``target_layer_ids`` at every position before P are concatenated, fused by ``fc`` and normed by
``hidden_norm`` into ``ctx`` [T, H]; each draft layer projects ``ctx`` with its own ``k_proj`` (then
``k_norm`` and RoPE at the context positions) and ``v_proj``, and its block queries attend to those
plus the block's own keys (non-causal within the block unless ``causal``). The layers are Qwen3-style
(per-head RMSNorm on queries and keys). Logits come from the target's frozen lm_head, or from an own
head over a draft vocabulary (``d2t``).

Training places many blocks in one sequence (:func:`block_attention_mask`): block j, anchored at
position a_j, sees the context of its own document strictly before a_j, and its own block. The same
pattern cut into tiles of whole blocks (:func:`block_tiles`, one SDPA per tile over the context span its
blocks see) or as a FlexAttention block mask (:func:`block_flex_mask`) skips the keys a block never reads
instead of scoring [Q, T + Q] per row (``BLOCK_MASKS`` names all three).

``target_layer_ids`` are HF hidden-state ids (1 = output of the first decoder layer), the project's
convention everywhere; vLLM's ``dflash_config.target_layer_ids`` count decoder-layer outputs from 0,
i.e. ``id - 1`` (the export converts). The last id, ``num_layers``, is excluded: HF applies the final
norm there and vLLM does not, so the two would read different states.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from draftheads.errors import DraftheadsError
from draftheads.heads.layers import DraftMLP, LayerSpec, RMSNorm, Rotary, apply_rope, repeat_kv

MAX_BLOCK_SIZE = 128
"""A block is verified as one tree: at most the engine's tree budget."""


def default_target_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's three layers (so one feature cache serves both), distinct and short of the last."""
    from draftheads.heads.eagle3 import default_aux_layer_ids

    ids = sorted({min(max(i, 1), num_layers - 1) for i in default_aux_layer_ids(num_layers)})
    return tuple(ids)


@dataclass
class DFlashConfig:
    layer: LayerSpec
    """Shape of each draft decoder layer."""
    vocab_size: int
    """Target vocabulary size."""
    target_layer_ids: tuple[int, ...]
    """HF hidden-state ids of the target layers whose states form the context (1 .. num_layers - 1)."""
    mask_token_id: int
    """Token id the masks stand for in exports (vLLM embeds it; here a learned ``mask_embedding`` is used)."""
    num_layers: int = 1
    """Draft decoder layers (1-5)."""
    block_size: int = 16
    """Tokens per block: the anchor plus ``block_size - 1`` masks (vLLM: num_speculative_tokens = block_size - 1)."""
    target_hidden_size: int | None = None
    """Target hidden size (defaults to the draft layer's)."""
    draft_vocab_size: int | None = None
    """Own lm_head over this many target tokens (``d2t``); None = the target's frozen lm_head, full vocabulary."""
    causal: bool = False
    """Causal attention within a block (default: every block token sees the whole block)."""
    sliding_window: int | None = None
    """Context positions a block sees, counted back from its anchor (None = all)."""

    def __post_init__(self):
        if isinstance(self.layer, dict):
            self.layer = LayerSpec(**self.layer)
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        ids = self.target_layer_ids
        if not ids or len(set(ids)) != len(ids) or list(ids) != sorted(ids) or min(ids) < 1:
            raise DraftheadsError(f"dflash target_layer_ids {list(ids)} must be distinct, ascending HF hidden-state "
                                  "ids >= 1 (1 = output of the first decoder layer)")
        if not 1 <= self.num_layers <= 5:
            raise DraftheadsError(f"dflash num_layers={self.num_layers} must be in 1..5")
        if not 2 <= self.block_size <= MAX_BLOCK_SIZE:
            raise DraftheadsError(f"dflash block_size={self.block_size} must be in 2..{MAX_BLOCK_SIZE} (one block is "
                                  "verified as one tree)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise DraftheadsError(f"dflash mask_token_id={self.mask_token_id} must be a token id below vocab_size")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise DraftheadsError(f"dflash draft_vocab_size={self.draft_vocab_size} must be in 1..vocab_size")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise DraftheadsError(f"dflash sliding_window={self.sliding_window} must be >= 1 (or null)")
        if self.target_hidden_size is None:
            self.target_hidden_size = self.layer.hidden_size

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def first_draft_slot(self) -> int:
        """Block slot whose output is the first draft; slot k then predicts position P + k + (1 - this).
        DFlash: 1 (the anchor's own output is unused)."""
        return 1

    @property
    def drafts_per_block(self) -> int:
        return self.block_size - self.first_draft_slot


class BlockAttention(nn.Module):
    """Qwen3-style attention whose keys are the injected context plus the block's own tokens."""

    def __init__(self, spec: LayerSpec):
        super().__init__()
        self.h, self.kvh, self.d = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
        hs = spec.hidden_size
        self.q_proj = nn.Linear(hs, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(hs, self.kvh * self.d, bias=False)
        self.v_proj = nn.Linear(hs, self.kvh * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, hs, bias=False)
        self.q_norm = RMSNorm(self.d, spec.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, spec.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, H] -> k, v [B, kvh, S, D] (k normed and rotated)."""
        b, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, s, self.kvh, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kvh, self.d).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_kv, mask):
        """x [B, Q, H] block tokens; ctx_kv (k, v) [B, kvh, T, D]; mask bool [B or 1, 1, Q, T + Q]
        (True = attend), or the same as :class:`BlockTiles` or a FlexAttention ``BlockMask``. Returns [B, Q, H]."""
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.h, self.d)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        if isinstance(mask, BlockTiles):
            out = tiled_block_attention(q, ctx_kv, (k, v), mask)
        elif isinstance(mask, BlockMask):
            k, v = torch.cat([ctx_kv[0], k], 2), torch.cat([ctx_kv[1], v], 2)
            out = _flex_attention(q.device)(q, k, v, block_mask=mask, enable_gqa=True)
        else:
            k, v = repeat_kv(torch.cat([ctx_kv[0], k], 2), torch.cat([ctx_kv[1], v], 2), self.h // self.kvh)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.h * self.d))


class BlockLayer(nn.Module):
    def __init__(self, spec: LayerSpec):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = BlockAttention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = DraftMLP(spec)

    def forward(self, x, cos, sin, ctx_kv, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashHead(nn.Module):
    head_type = "dflash"
    config_type = DFlashConfig

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * config.target_hidden_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.layer.rms_norm_eps)
        self.layers = nn.ModuleList([BlockLayer(config.layer) for _ in range(config.num_layers)])
        self.norm = RMSNorm(h, config.layer.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(h))
        if config.draft_vocab_size is not None:
            self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.rotary = Rotary(config.layer)

    def context(self, feats: torch.Tensor) -> torch.Tensor:
        """feats [B, T, n * H_target] (layers in target_layer_ids order) -> ctx [B, T, H]."""
        return self.hidden_norm(self.fc(feats))

    def context_kv(self, ctx: torch.Tensor, position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the injected keys and values of ``ctx`` [B, T, H] at ``position_ids`` [B, T]."""
        cos, sin = self.rotary(ctx, position_ids)
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def block_inputs(self, anchor_embeds: torch.Tensor) -> torch.Tensor:
        """anchor_embeds [B, N, H] (the target's embedding of each anchor token) -> [B, N * block_size, H]:
        each anchor followed by block_size - 1 mask embeddings."""
        b, n, h = anchor_embeds.shape
        masks = self.mask_embedding.to(anchor_embeds.dtype).expand(b, n, self.config.block_size - 1, h)
        return torch.cat([anchor_embeds[:, :, None], masks], 2).reshape(b, n * self.config.block_size, h)

    def forward(self, block_embeds, block_positions, ctx_kv, mask) -> torch.Tensor:
        """block_embeds [B, Q, H], block_positions [B, Q], ctx_kv from :meth:`context_kv`, mask bool
        [B, 1, Q, T + Q] (or its :class:`BlockTiles` or ``BlockMask`` form) -> normed hidden states [B, Q, H]
        (logits via :meth:`projection`)."""
        cos, sin = self.rotary(block_embeds, block_positions)
        x = block_embeds
        for layer, kv in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, kv, mask)
        return self.norm(x)

    def projection(self, target_lm_head: torch.Tensor | None = None) -> torch.Tensor:
        """[V', H] rows giving the logits: the own draft head, or the target's lm_head."""
        if self.config.draft_vocab_size is not None:
            return self.lm_head.weight
        if target_lm_head is None:
            raise DraftheadsError("this dflash head projects with the target's lm_head: pass it")
        return target_lm_head

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids] if self.config.draft_vocab_size is not None else ids


def context_visible(anchors: torch.Tensor, doc_ids: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """[B, N, T] True where block j (anchored at ``anchors`` [B, N], -1 = no block) sees context position t
    of its row (``doc_ids`` [B, T]): t in the anchor's document, t < a, and within ``sliding_window`` of a."""
    t = doc_ids.shape[1]
    a = anchors.clamp(min=0)
    pos = torch.arange(t, device=anchors.device)
    anchor_doc = doc_ids.gather(1, a)  # [B, N]
    ctx = (doc_ids[:, None, :] == anchor_doc[:, :, None]) & (pos[None, None, :] < a[:, :, None])
    if sliding_window is not None:
        ctx &= pos[None, None, :] >= (a - sliding_window)[:, :, None]
    return ctx & (anchors >= 0)[:, :, None]


def own_visible(q: int, block_size: int, causal: bool = False, device=None) -> torch.Tensor:
    """[Q, Q] True where query k of ``q`` consecutive block tokens sees key k': same block, and k' <= k if causal."""
    i = torch.arange(q, device=device)
    within = i[:, None] // block_size == i[None, :] // block_size
    return within & (i[None, :] <= i[:, None]) if causal else within


def block_attention_mask(anchors: torch.Tensor, doc_ids: torch.Tensor, block_size: int, causal: bool = False,
                         sliding_window: int | None = None) -> torch.Tensor:
    """Boolean attention mask [B, 1, N * block_size, T + N * block_size] (True = attend) for the blocks
    anchored at ``anchors`` [B, N] (-1 = no block) over a packed row with ``doc_ids`` [B, T].

    Query k of block j (anchor a) sees context position t when t is in a's document and t < a (and
    within ``sliding_window`` of a), and key k' of its own block when k' <= k or, non-causal, always.
    A block with no anchor sees nothing but itself (its loss is masked)."""
    b, n = anchors.shape
    q = n * block_size
    ctx = context_visible(anchors, doc_ids, sliding_window).repeat_interleave(block_size, dim=1)  # [B, Q, T]
    return torch.cat([ctx, own_visible(q, block_size, causal, anchors.device).expand(b, q, q)], -1)[:, None]


TILE_ROWS = 128
"""Query rows per tile of :func:`block_tiles` (rounded down to whole blocks, at least one)."""


@dataclass
class BlockTiles:
    """:func:`block_attention_mask` cut into tiles of whole blocks, each with the span of context keys its
    blocks see: a tile's queries attend to ``ctx[keys]`` and their own block tokens only, so no query is
    scored against another tile's blocks or context outside the span."""

    tiles: list[tuple[slice, slice, torch.Tensor]]
    """(query rows, context keys, bool mask [B, 1, rows, keys + rows]) per tile, in query order."""


def block_tiles(anchors: torch.Tensor, doc_ids: torch.Tensor, block_size: int, causal: bool = False,
                sliding_window: int | None = None, rows: int | None = None) -> BlockTiles:
    """The mask of :func:`block_attention_mask` as :class:`BlockTiles` of ``rows`` query rows (default
    ``TILE_ROWS``). With ascending
    anchors (as training draws them) a tile's span runs from its first block's document start to its last
    anchor, about half a row on average, instead of all T context keys plus all N * block_size block keys."""
    b, n = anchors.shape
    per = max((rows or TILE_ROWS) // block_size, 1)
    ctx = context_visible(anchors, doc_ids, sliding_window)  # [B, N, T]
    own = own_visible(per * block_size, block_size, causal, anchors.device)
    tiles = []
    for j in range(0, n, per):
        cols = ctx[:, j: j + per].any(1).any(0).nonzero()
        lo, hi = (int(cols[0]), int(cols[-1]) + 1) if len(cols) else (0, 0)
        m = ctx[:, j: j + per, lo:hi].repeat_interleave(block_size, dim=1)  # [B, rows, hi - lo]
        r = m.shape[1]
        tiles.append((slice(j * block_size, j * block_size + r), slice(lo, hi),
                      torch.cat([m, own[:r, :r].expand(b, r, r)], -1)[:, None]))
    return BlockTiles(tiles)


def tiled_block_attention(q: torch.Tensor, ctx_kv: tuple, own_kv: tuple, tiles: BlockTiles) -> torch.Tensor:
    """Attention of the block queries ``q`` [B, h, Q, D] over the context keys and values ``ctx_kv``
    ([B, kvh, T, D] each) and the blocks' own ``own_kv`` ([B, kvh, Q, D] each), one SDPA per tile of
    ``tiles``. The same as one SDPA under :func:`block_attention_mask`. Returns [B, h, Q, D]."""
    rep = q.shape[1] // ctx_kv[0].shape[1]
    outs = []
    for r, c, m in tiles.tiles:
        k, v = repeat_kv(torch.cat([ctx_kv[0][:, :, c], own_kv[0][:, :, r]], 2),
                         torch.cat([ctx_kv[1][:, :, c], own_kv[1][:, :, r]], 2), rep)
        outs.append(F.scaled_dot_product_attention(q[:, :, r], k, v, attn_mask=m))
    return torch.cat(outs, 2)


def block_flex_mask(anchors: torch.Tensor, doc_ids: torch.Tensor, block_size: int, causal: bool = False,
                    sliding_window: int | None = None) -> BlockMask:
    """:func:`block_attention_mask` as a FlexAttention ``BlockMask`` (the same attend pattern, block-sparse)."""
    b, n = anchors.shape
    t = doc_ids.shape[1]
    valid = anchors >= 0
    a = anchors.clamp(min=0)
    anchor_doc = doc_ids.gather(1, a)
    lowest = a - sliding_window if sliding_window is not None else torch.zeros_like(a)

    def attend(row, head, qi, ki):
        j = qi // block_size
        in_ctx = ki < t
        ctx = (in_ctx & valid[row, j] & (doc_ids[row, ki.clamp(max=t - 1)] == anchor_doc[row, j])
               & (ki < a[row, j]) & (ki >= lowest[row, j]))
        own = ~in_ctx & ((ki - t) // block_size == j)
        if causal:
            own = own & (ki - t <= qi)
        return ctx | own

    return create_block_mask(attend, b, None, n * block_size, t + n * block_size, device=anchors.device)


BLOCK_MASKS = {"sdpa": block_attention_mask, "tiles": block_tiles, "flex": block_flex_mask}
"""How a training step masks its blocks: a dense boolean mask for one SDPA, tiles of whole blocks with one SDPA
each over the context their blocks see, or a FlexAttention block mask."""


@functools.cache
def _flex_attention(device: torch.device):
    """FlexAttention compiled where it runs fused (CUDA); eager elsewhere (CPU forward only, for parity tests)."""
    return compiled_flex_attention() if device.type == "cuda" else _eager_flex_attention


def compiled_flex_attention(backend: str = "inductor"):
    """``flex_attention`` under ``torch.compile``, traced with TorchDynamo's DDPOptimizer off.

    Training under DDP runs this inside the wrapped module's forward, where Dynamo hands each graph to its
    DDPOptimizer to split by gradient bucket; older torch releases refuse a higher-order op there
    ("DDPOptimizer backend: Found a higher order op in the graph"), and FlexAttention is one. This graph
    holds no parameters, so there is nothing for DDPOptimizer to bucket."""
    compiled = torch.compile(flex_attention, dynamic=False, backend=backend)

    def run(*args, **kwargs):
        with torch._dynamo.config.patch(optimize_ddp=False):
            return compiled(*args, **kwargs)

    return run


def _eager_flex_attention(*args, **kwargs):
    with warnings.catch_warnings():  # eager materialises the scores: what a CPU parity check wants
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(*args, **kwargs)
