"""Medusa-1 training: heads on the target's last hidden state, Σ_k decay^k · CE."""

from __future__ import annotations

import torch

from draftheads.heads import MedusaConfig, MedusaHeads
from draftheads.heads.vocab import build_draft_vocab
from draftheads.training.losses import IGNORE_INDEX, medusa_loss
from draftheads.training.module import DraftHeadModule


class MedusaModule(DraftHeadModule):
    head_type = "medusa"

    def __init__(
        self,
        num_heads: int = 4,
        num_layers: int = 1,
        share_lm_head: bool = False,
        draft_vocab_size: int | None = None,
        labels: str = "target",
        decay: float = 0.8,
        **kwargs,
    ):
        """
        Args:
            num_heads: number of Medusa heads K.
            num_layers: residual blocks per head.
            share_lm_head: use the target's frozen lm_head instead of a trainable copy per head.
            draft_vocab_size: project onto the most frequent training tokens only (0 or None: full vocab).
            labels: ``target`` (the target's own argmax: self-distillation) or ``data`` (dataset tokens).
            decay: loss weight of head k is decay**k.
            **kwargs: see :class:`DraftHeadModule`.
        """
        super().__init__(**kwargs)
        if labels not in ("target", "data"):
            from draftheads.errors import DraftheadsError

            raise DraftheadsError(f"model.labels={labels!r}: use 'target' or 'data'")
        self.save_hyperparameters()

    def build_head(self, info, datamodule):
        hp = self.hparams
        token_map = None
        if hp.draft_vocab_size:
            token_map = build_draft_vocab(datamodule.token_counts(info.vocab_size), size=hp.draft_vocab_size).draft_ids
        head = MedusaHeads(MedusaConfig(
            hidden_size=info.hidden_size, vocab_size=info.vocab_size, num_heads=hp.num_heads,
            num_layers=hp.num_layers, share_lm_head=hp.share_lm_head, draft_vocab_size=hp.draft_vocab_size or None,
        ))
        head.init_from_target(self.lm_head_weight.detach().float(), token_map)
        return head

    def compute_loss(self, batch):
        n = self.info.num_layers
        h = self.features(batch, [n])[n]  # [B, T, H] last hidden state, post-norm
        if self.hparams.labels == "target":
            # the target's prediction at t-1 is the label of the token at t
            tokens = torch.cat([torch.full_like(batch["input_ids"][:, :1], IGNORE_INDEX),
                                self.target_argmax(batch, h)[:, :-1]], 1)
        else:
            tokens = batch["input_ids"]
        labels = self._to_head_vocab(tokens)
        feats = self.head(h)
        projs = [self.head.projection(k, self.lm_head_weight.to(h.dtype)) for k in range(self.head.config.num_heads)]
        loss, per_head, accs = medusa_loss(
            feats, projs, labels, batch["loss_mask"], batch["doc_ids"], decay=self.hparams.decay,
            impl=self.hparams.loss_impl, chunk_size=self.hparams.loss_chunk_size,
        )
        return loss, {f"loss_{k + 1}": v for k, v in enumerate(per_head)}, accs

    def _to_head_vocab(self, tokens: torch.Tensor) -> torch.Tensor:
        if not self.head.config.draft_vocab_size:
            return tokens
        lookup = torch.full((self.info.vocab_size,), IGNORE_INDEX, dtype=torch.long, device=tokens.device)
        lookup[self.head.token_map] = torch.arange(self.head.token_map.numel(), device=tokens.device)
        return torch.where(tokens >= 0, lookup[tokens.clamp(min=0)], tokens)
