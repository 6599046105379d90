"""EAGLE-3 draft head with training-time test (TTT).

Features from three target layers (HF hidden-state ids, default ``(2, L//2, L-3)``) are concatenated
and fused by ``fc`` (3H -> H, no bias) into g_t. Decoder layer 0 attends over
``cat(input_layernorm(embed(x_{t+1})), hidden_norm(g_t))`` (2H) with g_t as its residual; a final
``norm`` and an own ``lm_head`` over a draft vocabulary (``d2t``/``t2d``) give logits. With
``num_layers`` > 1, Llama decoder layers follow layer 0 (as vLLM's EAGLE-3 model stacks them); the last
layer's pre-norm output is the hidden input of the next drafting step.

Step j (0-based) at position t reads embed(x_{t+1+j}) and predicts x_{t+2+j}; its position id is t+j.
During training, step j attends to step 0's keys causally (the target-feature prefix) and to steps
1..j's keys of the same position only (the diagonal) -- exactly what a draft sees at inference time
after drafting j tokens on top of a real prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from draftheads.errors import DraftheadsError
from draftheads.heads.layers import DraftDecoderLayer, LayerSpec, RMSNorm, Rotary


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers (2, L // 2, L - 3), vLLM's default; a target too shallow for
    three distinct ones there (under 7 layers) gets three spread over its layers instead."""
    ids = (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) == 3:
        return ids
    return tuple(sorted({max(1, round(i * (num_layers - 1) / 3)) for i in (1, 2, 3)}))


@dataclass
class Eagle3Config:
    layer: LayerSpec
    """Shape of the draft decoder layer."""
    vocab_size: int
    """Target vocabulary size."""
    draft_vocab_size: int
    """Size of the draft vocabulary (own lm_head rows)."""
    aux_layer_ids: tuple[int, ...] = field(default=())
    """HF hidden-state ids of the target layers read (vLLM's eagle_aux_hidden_state_layer_ids)."""
    target_hidden_size: int | None = None
    """Target hidden size (defaults to the draft layer's)."""
    ttt_steps: int = 7
    """Training-time-test unroll length."""
    norm_before_residual: bool = False
    """Residual is hidden_norm(g) instead of g (vLLM flag of the same name)."""
    num_layers: int = 1
    """Decoder layers: layer 0 reads (embedding, g), the others are Llama layers over its output."""

    def __post_init__(self):
        if isinstance(self.layer, dict):
            self.layer = LayerSpec(**self.layer)
        self.aux_layer_ids = tuple(int(i) for i in self.aux_layer_ids)
        if len(self.aux_layer_ids) != 3:
            raise DraftheadsError(f"eagle3 aux_layer_ids {list(self.aux_layer_ids)} must name 3 target layers")
        if len(set(self.aux_layer_ids)) != 3:
            raise DraftheadsError(f"eagle3 aux_layer_ids {list(self.aux_layer_ids)} has duplicates: give 3 distinct ids")
        if self.target_hidden_size is None:
            self.target_hidden_size = self.layer.hidden_size
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise DraftheadsError(f"eagle3 draft_vocab_size={self.draft_vocab_size} must be in 1..vocab_size")
        if self.ttt_steps < 1:
            raise DraftheadsError(f"eagle3 ttt_steps={self.ttt_steps} must be >= 1")
        if self.num_layers < 1:
            raise DraftheadsError(f"eagle3 num_layers={self.num_layers} must be >= 1")

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size


class Eagle3Head(nn.Module):
    head_type = "eagle3"

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(3 * config.target_hidden_size, h, bias=False)
        self.layers = nn.ModuleList([DraftDecoderLayer(config.layer, eagle3=True)] + [
            DraftDecoderLayer(config.layer, eagle3=False, input_norm=True) for _ in range(config.num_layers - 1)])
        self.norm = RMSNorm(h, config.layer.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        # Per-layer scale dividing each aux hidden state before fc. Middle layers of many targets carry
        # massive activations (norms of 1e4); training in rescaled units keeps fc's updates in proportion.
        # Exports fold it into fc.weight, so served models are plain EAGLE-3.
        self.register_buffer("aux_scale", torch.ones(3))
        self.rotary = Rotary(config.layer)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B, T, 3*H_target] (layers concatenated in aux_layer_ids order) -> g [B, T, H]."""
        scaled = aux.unflatten(-1, (3, -1)) / self.aux_scale.to(aux.dtype)[:, None]
        return self.fc(scaled.flatten(-2))

    def folded_fc_weight(self) -> torch.Tensor:
        """fc.weight acting on unscaled aux states (what vLLM's fc computes)."""
        w = self.fc.weight
        return (w.unflatten(1, (3, -1)) / self.aux_scale.to(w.dtype)[None, :, None]).flatten(1)

    def forward(self, embeds, hidden, position_ids, mask=None, past_kv=None, cache=None, own_kv=None, rows=None,
                every_mask=None):
        """One drafting step. embeds, hidden [B, T, H] -> (pre-norm hidden [B, T, H], new (k, v) per layer);
        the keys and ``rows`` as in :meth:`~draftheads.heads.layers.DraftAttention.forward`, per layer:
        ``past_kv`` a list of (k, v), ``own_kv`` a list of (keys, values) lists, ``cache`` a
        :class:`~draftheads.inference.draft_kv.DraftStep`. With ``rows`` the layers before the last run at
        every position under ``every_mask`` (the last one's K/V read their outputs) and the last at those
        rows alone under ``mask``."""
        cos, sin = self.rotary(hidden, position_ids)
        if self.config.norm_before_residual:
            hidden = self.layers[0].hidden_norm(hidden)
        new, last = [], len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            hidden, kv = layer(hidden, cos, sin, embeds=embeds if i == 0 else None,
                               mask=mask if rows is None or i == last else every_mask,
                               past_kv=None if past_kv is None else past_kv[i],
                               cache=None if cache is None else cache.at(i),
                               own_kv=None if own_kv is None else own_kv[i],
                               rows=rows if i == last else None)
            new.append(kv)
        return hidden, new

    def normed(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)

    @torch.no_grad()
    def deepen(self, num_layers: int) -> None:
        """Grow to ``num_layers`` layers without changing the function: each new Llama layer starts with its
        ``o_proj`` and ``down_proj`` at zero, a residual that passes its input through (and trains from the
        first step on, through those two projections' gradients)."""
        if num_layers < len(self.layers):
            raise DraftheadsError(f"num_layers {num_layers} is below the head's {len(self.layers)}: a head only deepens")
        like = self.fc.weight
        while len(self.layers) < num_layers:
            layer = DraftDecoderLayer(self.config.layer, eagle3=False, input_norm=True).to(like.device, like.dtype)
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            self.layers.append(layer)
        self.config.num_layers = num_layers

    def projection(self, target_lm_head: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head.weight

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids]

    def ttt(
        self,
        aux: torch.Tensor,  # [B, T, 3*H_target]
        step_embeds,  # callable j -> [B, T, H]: embed(x_{t+1+j}) (zeros past the end)
        position_ids: torch.Tensor,  # [B, T]
        prefix_mask: torch.Tensor,  # additive [B, 1, T, T]: causal within documents
        steps: int | None = None,
        keep: torch.Tensor | None = None,  # [B, T] bool: the positions whose outputs are needed
    ) -> list[torch.Tensor]:
        """Unrolled training-time test: the normed outputs [B, T, H] of steps 0..steps-1.

        Step 0's keys and values at every position are every later step's prefix; the rest of a step at
        t feeds only its own position's later steps. So with ``keep`` (the positions some step's loss
        scores) everything but step 0's keys and values runs at the kept positions alone (each row's,
        padded to the row with the most), and the outputs are zero elsewhere: the same values where kept,
        for the cost of the kept positions."""
        steps = steps or self.config.ttt_steps
        hidden = self.fuse(aux)
        b, t = position_ids.shape
        every_mask = prefix_mask
        if keep is None:
            rows = back = None
            at = position_ids
        else:
            width = max(int(keep.sum(1).max()), 1)
            rows = torch.sort(keep.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :width]  # [B, W]
            back = torch.where(torch.gather(keep, 1, rows), rows, t)[:, :, None]  # a shorter row's padding: past the end
            prefix_mask = prefix_mask.expand(b, 1, t, prefix_mask.shape[-1]).gather(
                2, rows[:, None, :, None].expand(-1, 1, -1, prefix_mask.shape[-1]))
            at = position_ids.gather(1, rows)

        def output(hidden):
            out = self.normed(hidden)
            if back is None:
                return out
            return out.new_zeros(b, t + 1, out.shape[-1]).scatter(1, back.expand(-1, -1, out.shape[-1]), out)[:, :t]

        own = [([], []) for _ in self.layers]  # step 0: each layer's masked attention over its new K/V
        hidden, prefix_kv = self.forward(step_embeds(0), hidden, position_ids, mask=prefix_mask, own_kv=own,
                                         rows=rows, every_mask=every_mask)
        outs = [output(hidden)]
        for j in range(1, steps):
            # step j's token at t reads step 0's entries up to t and its own position's entries of steps 1..j
            embeds = step_embeds(j)
            if rows is not None:
                embeds = embeds.gather(1, rows[:, :, None].expand(-1, -1, embeds.shape[-1]))
            hidden, kv = self.forward(embeds, hidden, at + j, mask=prefix_mask, past_kv=prefix_kv, own_kv=own)
            own = [(k + [new[0]], v + [new[1]]) for (k, v), new in zip(own, kv)]
            outs.append(output(hidden))
        return outs

