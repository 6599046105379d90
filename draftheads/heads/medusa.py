"""Medusa-1 heads.

Convention (written once, here): the target's ``lm_head`` on hidden state h_t predicts x_{t+1};
Medusa head k (k = 1..K) on h_t predicts x_{t+1+k}. Head index ``k-1`` in code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftheads.errors import DraftheadsError


@dataclass
class MedusaConfig:
    hidden_size: int
    """Target hidden size H (each block is Linear(H, H))."""
    vocab_size: int
    """Target vocabulary size."""
    num_heads: int = 4
    """K, the number of heads; head k predicts the token k+1 positions after the next one."""
    num_layers: int = 1
    """Residual blocks per head."""
    share_lm_head: bool = False
    """Use the target's frozen lm_head for every head instead of a trainable copy per head."""
    draft_vocab_size: int | None = None
    """Project onto this many target tokens (``token_map``) instead of the full vocabulary."""

    def __post_init__(self):
        for name in ("hidden_size", "vocab_size", "num_heads"):
            if getattr(self, name) < 1:
                raise DraftheadsError(f"medusa {name}={getattr(self, name)} must be >= 1")
        if self.num_layers < 0:
            raise DraftheadsError(f"medusa num_layers={self.num_layers} must be >= 0")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise DraftheadsError(f"medusa draft_vocab_size={self.draft_vocab_size} must be in 1..vocab_size")

    @property
    def out_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size


class ResBlock(nn.Module):
    """x + SiLU(Linear(x)), Linear weight zero-initialised so a new head starts as the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x):
        return x + F.silu(self.linear(x))


class MedusaBlocks(nn.Module):
    def __init__(self, hidden_size: int, num_layers: int):
        super().__init__()
        # a fresh module per layer: `[ResBlock(h)] * n` would share one
        self.layers = nn.ModuleList(ResBlock(hidden_size) for _ in range(num_layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class MedusaHeads(nn.Module):
    head_type = "medusa"

    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        c = config
        self.blocks = nn.ModuleList(MedusaBlocks(c.hidden_size, c.num_layers) for _ in range(c.num_heads))
        if not c.share_lm_head:
            self.lm_heads = nn.ModuleList(nn.Linear(c.hidden_size, c.out_vocab, bias=False) for _ in range(c.num_heads))
        if c.draft_vocab_size:
            self.register_buffer("token_map", torch.arange(c.draft_vocab_size, dtype=torch.int64))

    @torch.no_grad()
    def init_from_target(self, lm_head_weight: torch.Tensor, token_map: torch.Tensor | None = None) -> None:
        """Copy the target's lm_head rows (restricted to ``token_map``) into each head's projection."""
        if self.config.draft_vocab_size:
            if token_map is None or token_map.numel() != self.config.draft_vocab_size:
                raise DraftheadsError("medusa: a draft vocabulary needs a token_map of draft_vocab_size target ids")
            self.token_map.copy_(token_map)
        if not self.config.share_lm_head:
            rows = self.restrict(lm_head_weight)
            for head in self.lm_heads:
                head.weight.copy_(rows)

    def restrict(self, weight: torch.Tensor) -> torch.Tensor:
        """Rows of a full-vocab projection that this head projects onto."""
        return weight[self.token_map] if self.config.draft_vocab_size else weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] (target last hidden state, post-norm) -> [K, B, T, H] pre-projection."""
        assert hidden.shape[-1] == self.config.hidden_size, hidden.shape
        return torch.stack([blocks(hidden) for blocks in self.blocks])

    def projection(self, k: int, target_lm_head: torch.Tensor | None = None) -> torch.Tensor:
        """Weight [out_vocab, H] of head k (0-based)."""
        if self.config.share_lm_head:
            if target_lm_head is None:
                raise DraftheadsError("medusa head shares the target's lm_head: pass the target's lm_head weight")
            return self.restrict(target_lm_head)
        return self.lm_heads[k].weight

    def logits(self, hidden: torch.Tensor, target_lm_head: torch.Tensor | None = None) -> torch.Tensor:
        """[.., H] -> [K, .., out_vocab] logits (draft-vocab indices when token_map is set)."""
        feats = self.forward(hidden)
        return torch.stack([feats[k] @ self.projection(k, target_lm_head).T for k in range(self.config.num_heads)])

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.token_map[ids] if self.config.draft_vocab_size else ids
