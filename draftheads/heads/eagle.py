"""EAGLE-1 draft head.

At position t the head reads ``cat(embed(x_{t+1}), f_t)`` (embedding first; f = the target's last
hidden state after its final norm), passes it through ``fc`` (2H -> H, no bias) and one Llama decoder
layer without ``input_layernorm``, and returns f̂_{t+1}, a prediction of the target's next feature.
Logits come from the target's frozen lm_head (or a draft-vocabulary lm_head): f̂_{t+1} predicts
x_{t+2}. There is no final norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from draftheads.errors import DraftheadsError
from draftheads.heads.layers import DraftDecoderLayer, LayerSpec, Rotary


@dataclass
class EagleConfig:
    layer: LayerSpec
    """Shape of the draft decoder layer (the target's, by default)."""
    vocab_size: int
    """Target vocabulary size."""
    draft_vocab_size: int | None = None
    """Own lm_head over this many target tokens (``d2t``/``t2d``) instead of the target's lm_head."""
    fc_bias: bool = False
    """``fc`` with a bias (SafeAILab EAGLE-1 checkpoints have one; vLLM drops it, so train without)."""

    def __post_init__(self):
        if isinstance(self.layer, dict):
            self.layer = LayerSpec(**self.layer)
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise DraftheadsError(f"eagle draft_vocab_size={self.draft_vocab_size} must be in 1..vocab_size")

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size


class EagleHead(nn.Module):
    head_type = "eagle"

    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=config.fc_bias)
        self.layers = nn.ModuleList([DraftDecoderLayer(config.layer, eagle3=False)])
        self.rotary = Rotary(config.layer)
        if config.draft_vocab_size:
            self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    def forward(self, embeds, features, position_ids, mask=None, past_kv=None, cache=None):
        """embeds, features [B, T, H]; position_ids [B, T] -> (f̂ [B, T, H], new (k, v))."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        cos, sin = self.rotary(x, position_ids)
        return self.layers[0](x, cos, sin, mask=mask, past_kv=past_kv, cache=cache)

    def normed(self, hidden: torch.Tensor) -> torch.Tensor:
        """Input of the vocabulary projection (EAGLE-1 has no final norm)."""
        return hidden

    def projection(self, target_lm_head: torch.Tensor | None = None) -> torch.Tensor:
        if self.config.draft_vocab_size:
            return self.lm_head.weight
        if target_lm_head is None:
            raise DraftheadsError("eagle head shares the target's lm_head: pass the target's lm_head weight")
        return target_lm_head

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids] if self.config.draft_vocab_size else ids

