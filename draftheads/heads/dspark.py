"""DSpark: the DFlash block drafter plus a Markov head and a confidence head.

* **Markov head**: a rank-r bias on each block position's logits from the token before it,
  ``markov_w2(markov_w1[previous target id])``, so a block is decoded left to right in one pass over
  cheap [r] x [r, V'] products after the one backbone forward. The bias folds into the projection:
  ``[h, e] @ [W, W2]^T = h W^T + e W2^T`` (:meth:`DSparkHead.markov_projection`), which is how the
  fused losses take it.
* **Confidence head**: ``sigmoid(proj([h, e]))`` (``e`` only with ``confidence_with_markov``), the
  estimated probability that the draft at a position is accepted given that the ones before it were;
  the running product is a draft's survival probability, which trims each request's verified length.
* **Anchor mode** (``sample_from_anchor``, vLLM's default): slot k of the block (the anchor at k = 0)
  predicts the token at P + k + 1, so a block of B slots drafts B tokens. Off, the layout is DFlash's:
  the anchor's own output is unused and B slots draft B - 1.

The mask slots are embedded as the target's row of ``mask_token_id``, never learned and not saved with
the head (:meth:`DSparkHead.use_target_mask`): vLLM's DSpark reads ``embed_tokens[mask_token_id]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from draftheads.errors import DraftheadsError
from draftheads.heads.dflash import DFlashConfig, DFlashHead


@dataclass
class DSparkConfig(DFlashConfig):
    markov_rank: int = 64
    """Rank r of the Markov bias (0 = none: the backbone's logits alone)."""
    confidence_head: bool = True
    """Per-position acceptance estimate (trims the verified length per request)."""
    confidence_with_markov: bool = True
    """The confidence head reads the Markov embedding of the previous token besides the hidden state."""
    sample_from_anchor: bool = True
    """Slot k predicts P + k + 1 (the anchor's output is the first draft): B slots draft B tokens."""

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.markov_rank <= 4096:
            raise DraftheadsError(f"dspark markov_rank={self.markov_rank} must be in 0..4096 (0 = no Markov head)")
        if self.confidence_with_markov and not self.markov_rank:
            raise DraftheadsError("dspark confidence_with_markov needs markov_rank >= 1: set one of them differently")

    @property
    def first_draft_slot(self) -> int:
        return 0 if self.sample_from_anchor else 1


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # indexed by the previous token's target id
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1)


class DSparkHead(DFlashHead):
    head_type = "dspark"
    config_type = DSparkConfig

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        del self.mask_embedding  # not learned, not saved: whoever builds the head sets the target's row
        self.register_buffer("mask_embedding", torch.zeros(config.hidden_size), persistent=False)
        r = config.markov_rank
        out_vocab = config.draft_vocab_size or config.vocab_size
        if r:
            self.markov_head = MarkovHead(config.vocab_size, out_vocab, r)
            nn.init.zeros_(self.markov_head.markov_w2.weight)  # starts as the backbone alone
        if config.confidence_head:
            self.confidence_head = ConfidenceHead(config.hidden_size + (r if config.confidence_with_markov else 0))

    def use_target_mask(self, target_embedding: torch.Tensor) -> None:
        """Embed the mask slots as the target's row of ``mask_token_id`` (target_embedding [V, H])."""
        with torch.no_grad():
            self.mask_embedding.copy_(target_embedding[self.config.mask_token_id].to(self.mask_embedding))

    def markov_embed(self, prev_ids: torch.Tensor) -> torch.Tensor | None:
        """Target ids of the previous tokens [...] -> [..., r] (None without a Markov head)."""
        return self.markov_head.markov_w1(prev_ids) if self.config.markov_rank else None

    def markov_inputs(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] and previous target ids [...] -> [..., H + r], the rows :meth:`markov_projection`
        projects."""
        e = self.markov_embed(prev_ids)
        return hidden if e is None else torch.cat([hidden, e.to(hidden.dtype)], -1)

    def markov_projection(self, target_lm_head: torch.Tensor | None = None) -> torch.Tensor:
        """[V', H + r]: logits = :meth:`markov_inputs` @ this^T (backbone logits plus the Markov bias)."""
        w = self.projection(target_lm_head)
        if not self.config.markov_rank:
            return w
        return torch.cat([w, self.markov_head.markov_w2.weight.to(w.dtype)], 1)

    def confidence_logit(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], previous target ids [...] -> [...] logit of the acceptance estimate."""
        if not self.config.confidence_head:
            raise DraftheadsError("this dspark head has no confidence head (confidence_head: false)")
        x = self.markov_inputs(hidden, prev_ids) if self.config.confidence_with_markov else hidden
        w = self.confidence_head.proj
        return (x.float() @ w.weight.float().T + w.bias.float())[..., 0]
