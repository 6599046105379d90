"""Building blocks of EAGLE draft layers: a Llama-style decoder layer whose attention reads explicit
masks and an explicit past K/V, so that training (TTT masks) and tree drafting share one module.

Parameter names follow Llama (``self_attn.q_proj``, ``mlp.gate_proj``, ``input_layernorm`` ...), which
are the names vLLM's EAGLE loaders expect under ``layers.0.``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftheads.errors import DraftheadsError


@dataclass
class LayerSpec:
    """Shape of one draft decoder layer, read from the target's config."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope_parameters beyond the default type (e.g. llama3)
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise DraftheadsError(f"layer {name}={getattr(self, name)} must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DraftheadsError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    @classmethod
    def from_hf_config(cls, cfg) -> LayerSpec:
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        heads = cfg.num_attention_heads
        return cls(
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=getattr(cfg, "max_position_embeddings", 2048),
            hidden_act=getattr(cfg, "hidden_act", "silu"),
        )

    def llama_config(self, **extra):
        """The equivalent ``LlamaConfig`` (one decoder layer), used for RoPE and for export."""
        from transformers import LlamaConfig

        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta}
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=rope,
            max_position_embeddings=self.max_position_embeddings,
            hidden_act=self.hidden_act,
            num_hidden_layers=1,
            **extra,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """RoPE cos/sin for position ids, with the target's rope type (via transformers' rope init)."""

    def __init__(self, spec: LayerSpec):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.inner = LlamaRotaryEmbedding(spec.llama_config())

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        return self.inner(x, position_ids)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, heads, T, D]; cos/sin [B, T, D]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


OWN_BLOCK = 128
"""Query rows per block in :func:`prefix_and_own_attention` (more where a row would make more than
``OWN_BLOCKS`` blocks)."""
OWN_BLOCKS = 8
"""Most blocks a row is cut into (one attention call each)."""


def repeat_kv(keys: torch.Tensor, values: torch.Tensor, rep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V [B, kvh, S, D] with each head repeated ``rep`` times for the query heads (grouped-query attention)."""
    if rep == 1:
        return keys, values
    return keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)


def masked_own_attention(q: torch.Tensor, prefix: tuple, own: tuple, mask: torch.Tensor) -> torch.Tensor:
    """:func:`prefix_and_own_attention` as one attention over S + n T keys, every own-position block masked
    to its diagonal."""
    b, h, t, _ = q.shape
    diag = torch.full((t, t), float("-inf"), dtype=mask.dtype, device=mask.device).fill_diagonal_(0.0)
    keys, values = repeat_kv(torch.cat([prefix[0], *own[0]], 2), torch.cat([prefix[1], *own[1]], 2),
                             h // prefix[0].shape[1])
    m = torch.cat([mask.expand(b, 1, t, -1), *[diag.expand(b, 1, t, t)] * len(own[0])], -1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=m)


def prefix_and_own_attention(q: torch.Tensor, prefix: tuple, own: tuple, mask: torch.Tensor,
                             block: int | None = None) -> torch.Tensor:
    """Attention of ``q`` [B, h, T, D] over the prefix keys and values ``prefix`` ([B, kvh, S, D] each)
    under the additive ``mask`` [B or 1, 1, T, S], and over ``own`` (lists of n [B, kvh, T, D]): keys
    that query t reads at position t only (training-time test: a step's token also sees the earlier
    steps' entries at its own position). The same as :func:`masked_own_attention`, one attention over
    S + n T keys with diagonal own-position blocks in its mask, but taken block by block of ``block``
    query rows (default ``OWN_BLOCK``, at most ``OWN_BLOCKS`` blocks a row): a block reads the prefix
    keys from the first to the last one any of its rows sees (under a causal mask over packed documents,
    about half of its document's) and its own rows of ``own``, n * block keys instead of n T.
    Returns [B, h, T, D]."""
    b, h, t, d = q.shape
    s = prefix[0].shape[2]
    n, c = len(own[0]), min(max(block or OWN_BLOCK, -(-t // OWN_BLOCKS)), t)
    mask = mask.expand(b, 1, t, s)
    seen = mask[:, 0] > torch.finfo(mask.dtype).min / 2  # [B, T, S]
    keys_at = torch.arange(s, device=mask.device)
    last = torch.where(seen, keys_at + 1, 0).amax(-1).amax(0)  # [T]: one past the last key a row sees
    first = torch.where(seen, keys_at, s).amin(-1).amin(0)  # [T]: the first (S where it sees none)
    ends = F.pad(last, (0, -t % c)).view(-1, c).amax(1).tolist()  # the prefix keys each block reads
    starts = F.pad(first, (0, -t % c), value=s).view(-1, c).amin(1).tolist()
    rep = h // prefix[0].shape[1]
    eye = torch.full((c, c), float("-inf"), dtype=mask.dtype, device=mask.device).fill_diagonal_(0.0)
    outs = []
    for i, a, e in zip(range(0, t, c), starts, ends):
        j, a = min(i + c, t), min(a, e)
        keys = torch.cat([prefix[0][:, :, a:e], *[k[:, :, i:j] for k in own[0]]], 2)  # [B, kvh, e - a + n r, D]
        values = torch.cat([prefix[1][:, :, a:e], *[v[:, :, i:j] for v in own[1]]], 2)
        keys, values = repeat_kv(keys, values, rep)  # as the uncached path of DraftAttention does
        diag = eye[: j - i, : j - i].repeat(1, n).expand(b, 1, j - i, n * (j - i))
        m = torch.cat([mask[:, :, i:j, a:e], diag], -1)
        outs.append(F.scaled_dot_product_attention(q[:, :, i:j], keys, values, attn_mask=m))
    return torch.cat(outs, 2)


class DraftAttention(nn.Module):
    def __init__(self, spec: LayerSpec, in_features: int):
        super().__init__()
        self.h, self.kvh, self.d = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
        self.q_proj = nn.Linear(in_features, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(in_features, self.kvh * self.d, bias=False)
        self.v_proj = nn.Linear(in_features, self.kvh * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, spec.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask=None, past_kv=None, cache=None, own_kv=None, rows=None):
        """x [B, T, in]; mask additive [B or 1, 1, T, S] over keys (past, new) or None = causal.
        With ``cache`` (a :class:`~draftheads.inference.draft_kv.DraftStep`) the new K/V are written
        there and the keys are the cache's, S of them, instead of ``past_kv``. With
        ``own_kv`` (lists of [B, kvh, T, D]) attention goes through :func:`prefix_and_own_attention`:
        ``mask`` covers ``past_kv`` only, and each query also reads its own position of the new K/V and
        of ``own_kv``; without ``past_kv``, ``mask`` covers the new K/V and each query reads its own
        position of ``own_kv`` (``([], [])``: the masked attention over the new K/V, taken in blocks).

        With ``rows`` ([B, R] positions; the masked attention over the new K/V only, ``own_kv=([], [])``)
        the queries are those positions' alone, ``mask`` [B, 1, R, T] their rows: every position's K/V,
        the output of the R queried ones.

        Returns (out [B, T, H], (k, v)) with k/v [B, kvh, T, D] for the new tokens only.
        """
        b, t, _ = x.shape
        k = self.k_proj(x).view(b, t, self.kvh, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kvh, self.d).transpose(1, 2)
        k = apply_rope(k, cos, sin)
        if rows is not None:
            if past_kv is not None or own_kv is None or own_kv[0]:
                raise ValueError("rows: only the masked attention over the new K/V (own_kv=([], [])) queries a subset")
            x, cos, sin = (z.gather(1, rows[:, :, None].expand(-1, -1, z.shape[-1])) for z in (x, cos, sin))
            t = rows.shape[1]
        q = apply_rope(self.q_proj(x).view(b, t, self.h, self.d).transpose(1, 2), cos, sin)
        new_kv = (k, v)
        if own_kv is not None:
            if past_kv is None:
                out = prefix_and_own_attention(q, (k, v), own_kv, mask)
            else:
                out = prefix_and_own_attention(q, past_kv, ([k, *own_kv[0]], [v, *own_kv[1]]), mask)
            return self.o_proj(out.transpose(1, 2).reshape(b, t, self.h * self.d)), new_kv
        if cache is not None:
            k_all, v_all = cache.update(k, v)
            out = F.scaled_dot_product_attention(q, k_all.to(q.dtype), v_all.to(q.dtype), attn_mask=mask,
                                                 enable_gqa=self.h != self.kvh)
            return self.o_proj(out.transpose(1, 2).reshape(b, t, self.h * self.d)), new_kv
        k_all, v_all = (k, v) if past_kv is None else (torch.cat([past_kv[0], k], 2), torch.cat([past_kv[1], v], 2))
        k_all, v_all = repeat_kv(k_all, v_all, self.h // self.kvh)
        if mask is None and past_kv is None:
            out = F.scaled_dot_product_attention(q, k_all, v_all, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
        out = out.transpose(1, 2).reshape(b, t, self.h * self.d)
        return self.o_proj(out), new_kv


class DraftMLP(nn.Module):
    def __init__(self, spec: LayerSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)
        if spec.hidden_act != "silu":
            raise ValueError(f"hidden_act {spec.hidden_act!r} is not supported by draft layers: use 'silu'")

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    @torch.no_grad()
    def widen(self, size: int) -> None:
        """Grow to ``size`` intermediate units without changing the function: the new units' gate and up
        rows start as a fresh layer's, their down_proj columns at zero (so they train from the first step
        on, through down_proj's gradient)."""
        old = self.down_proj.in_features
        if size < old:
            raise DraftheadsError(f"intermediate_size {size} is below the head's {old}: a head only widens")
        h = self.down_proj.out_features
        like = self.down_proj.weight
        for name in ("gate_proj", "up_proj"):
            grown = nn.Linear(h, size, bias=False, device=like.device, dtype=like.dtype)
            grown.weight[:old] = getattr(self, name).weight
            setattr(self, name, grown)
        down = nn.Linear(size, h, bias=False, device=like.device, dtype=like.dtype)
        down.weight.zero_()
        down.weight[:, :old] = like
        self.down_proj = down


class DraftDecoderLayer(nn.Module):
    """One Llama decoder layer for a draft head.

    * EAGLE-1 (``eagle3=False``): input ``x`` [B, T, H]; no ``input_layernorm`` (identity).
    * EAGLE-3 (``eagle3=True``): inputs ``embeds`` and ``hidden``, each [B, T, H]; attention reads
      ``cat(input_layernorm(embeds), hidden_norm(hidden))`` (2H), the residual is ``hidden``.
    * A Llama layer (``input_norm=True``): attention reads ``input_layernorm(x)``; an EAGLE-3 head's layers
      after its first.
    """

    def __init__(self, spec: LayerSpec, eagle3: bool, input_norm: bool = False):
        super().__init__()
        self.eagle3, self.input_norm = eagle3, input_norm and not eagle3
        h = spec.hidden_size
        if eagle3 or input_norm:
            self.input_layernorm = RMSNorm(h, spec.rms_norm_eps)
        if eagle3:
            self.hidden_norm = RMSNorm(h, spec.rms_norm_eps)
        self.self_attn = DraftAttention(spec, 2 * h if eagle3 else h)
        self.post_attention_layernorm = RMSNorm(h, spec.rms_norm_eps)
        self.mlp = DraftMLP(spec)

    def forward(self, hidden, cos, sin, embeds=None, mask=None, past_kv=None, cache=None, own_kv=None, rows=None):
        """One layer; with ``rows`` ([B, R] positions) K/V at every position and the rest at those alone
        (see :meth:`DraftAttention.forward`): hidden out [B, R, H]."""
        residual = hidden if rows is None else hidden.gather(1, rows[:, :, None].expand(-1, -1, hidden.shape[-1]))
        if self.eagle3:
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        else:
            x = self.input_layernorm(hidden) if self.input_norm else hidden
        attn, new_kv = self.self_attn(x, cos, sin, mask=mask, past_kv=past_kv, cache=cache, own_kv=own_kv, rows=rows)
        hidden = residual + attn
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, new_kv
