"""DSpark training: DFlash's blocks (:class:`~draftheads.training.dflash.DFlashModule`), with the Markov
bias on each position's logits and a confidence head.

Each draft j of a block is scored with the token before it from the data (teacher forcing; at j = 1 the
anchor itself), the same token the engine's left-to-right decoding conditions on once the drafts before
it are accepted. Per draft, weighted by exp(-(j - 1) / B):

* ``ce_weight * CE + tv_weight * TV(p_target, q)`` (+ ``kl_weight * KL``) through one chunked fused
  projection (:func:`~draftheads.training.losses.linear_block_distill`; the Markov bias folds into it);
* ``confidence_weight * BCE(confidence, label)``: the label is the probability that rejection sampling
  accepts the draft, sum_x min(p, q) = 1 - TV (``confidence_label: soft``), or whether the draft's top
  token is the target's (``greedy``, what verification at T = 0 accepts).

Validation logs ``val/ece``, the expected calibration error of the confidence over 10 equal-width bins,
against the same label.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftheads.errors import DraftheadsError
from draftheads.heads.dspark import DSparkHead
from draftheads.training.dflash import DFlashModule, position_weight
from draftheads.training.losses import IGNORE_INDEX, linear_block_distill

CONFIDENCE_LABELS = ("soft", "greedy")
ECE_BINS = 10


def calibration_bins(conf: torch.Tensor, label: torch.Tensor, bins: int = ECE_BINS) -> torch.Tensor:
    """[3, bins] per confidence bin: count, sum of confidences, sum of labels (sums add across batches)."""
    idx = (conf.float() * bins).long().clamp(0, bins - 1)
    out = torch.zeros(3, bins, dtype=torch.float64, device=conf.device)
    out[0].index_add_(0, idx, torch.ones_like(conf, dtype=torch.float64))
    out[1].index_add_(0, idx, conf.double())
    out[2].index_add_(0, idx, label.double())
    return out


def expected_calibration_error(bins: torch.Tensor) -> float:
    """sum over bins of |sum conf - sum label| / N, from :func:`calibration_bins`."""
    n = float(bins[0].sum())
    return float((bins[1] - bins[2]).abs().sum()) / n if n else float("nan")


class DSparkModule(DFlashModule):
    head_type = "dspark"
    head_class = DSparkHead

    def __init__(
        self,
        markov_rank: int = 64,
        confidence_head: bool = True,
        confidence_with_markov: bool = True,
        sample_from_anchor: bool = True,
        ce_weight: float = 0.1,
        tv_weight: float = 0.9,
        kl_weight: float = 0.0,
        confidence_weight: float = 1.0,
        confidence_label: str = "soft",
        **kwargs,
    ):
        """
        Args:
            markov_rank: rank of the Markov bias from the previous token (0 = none).
            confidence_head: train a per-position acceptance estimate.
            confidence_with_markov: the confidence head also reads the previous token's Markov embedding.
            sample_from_anchor: the anchor's output is the first draft (B slots draft B tokens; serve with
                num_speculative_tokens = block_size); off, DFlash's layout (B - 1).
            ce_weight: weight of cross-entropy to the data's token.
            tv_weight: weight of the total variation distance to the target's distribution.
            kl_weight: weight of KL(p_target || q).
            confidence_weight: weight of the confidence head's BCE.
            confidence_label: ``soft`` (sum_x min(p, q), acceptance under sampling) or ``greedy`` (top-1
                agreement, acceptance at T = 0).
            **kwargs: see :class:`DFlashModule` (``loss`` is not used: the weights above choose the loss).
        """
        super().__init__(**kwargs)
        self.save_hyperparameters()
        if confidence_label not in CONFIDENCE_LABELS:
            raise DraftheadsError(f"model.confidence_label={confidence_label!r}: use one of {list(CONFIDENCE_LABELS)}")
        weights = {"ce_weight": ce_weight, "tv_weight": tv_weight, "kl_weight": kl_weight,
                   "confidence_weight": confidence_weight}
        for name, w in weights.items():
            if not w >= 0:
                raise DraftheadsError(f"model.{name}={w} must be >= 0")
        if self.hparams.position_weighting != "decay":
            raise DraftheadsError("model.position_weighting: DSpark weighs its drafts by position decay; use decay")
        if ce_weight + tv_weight + kl_weight <= 0:
            raise DraftheadsError("model.ce_weight, tv_weight and kl_weight are all 0: give the drafts a loss")
        self._calibration = None

    def extra_config(self) -> dict:
        hp = self.hparams
        return {"markov_rank": hp.markov_rank, "confidence_head": hp.confidence_head,
                "confidence_with_markov": hp.confidence_with_markov, "sample_from_anchor": hp.sample_from_anchor}

    def compute_loss(self, batch):
        hp, cfg = self.hparams, self.head.config
        b = self.block_forward(batch)
        ids = batch["input_ids"]
        w_student = self.head.projection(self.lm_head_weight).to(b.out.dtype)
        w_markov = self.head.markov_head.markov_w2.weight if cfg.markov_rank else None
        w_teacher = self.teacher_weight(b.last.dtype)
        labels = self.in_head_vocab(ids, IGNORE_INDEX)  # the head's classes of the row's tokens
        total = b.out.new_zeros((), dtype=torch.float32)
        logs, accs = {}, []
        for j, k in b.draft_slots(cfg):
            if not b.valid[:, :, k].any():
                accs.append(float("nan"))
                total = total + b.out.sum() * 0.0 + sum(p.sum() for p in self.head.parameters()) * 0.0  # DDP
                continue
            hs, rows, pred = b.rows(k)
            prev = ids[rows, pred - 1]  # the token before the predicted one (the anchor at j = 1)
            e = self.head.markov_embed(prev)  # the Markov bias e @ w2^T rides in the fused projection
            lk, accept, top = linear_block_distill(hs, w_student, b.last[rows, pred - 1], w_teacher,
                                                   labels[rows, pred],
                                                   hp.ce_weight, hp.tv_weight, hp.kl_weight, hp.loss_chunk_size,
                                                   bias_in=None if e is None else e.to(hs.dtype), bias_w=w_markov,
                                                   impl=hp.loss_impl)
            weight = position_weight(j, cfg.block_size)
            hit = (self.head.to_target_ids(top) == b.argmax[rows, pred - 1]).float()
            total = total + weight * lk
            logs[f"loss_{j}"] = lk.detach()
            accs.append(hit.mean().item())
            if cfg.confidence_head:
                label = accept if hp.confidence_label == "soft" else hit
                logit = self.head.confidence_logit(hs, prev)
                bce = F.binary_cross_entropy_with_logits(logit, label.detach().to(logit.dtype))
                total = total + hp.confidence_weight * weight * bce
                logs[f"confidence_{j}"] = bce.detach()
                if not self.training and self._calibration is not None:
                    self._calibration += calibration_bins(torch.sigmoid(logit.detach()), label.detach())
        return total, logs, accs

    def on_validation_epoch_start(self):
        super().on_validation_epoch_start()
        self._calibration = torch.zeros(3, ECE_BINS, dtype=torch.float64, device=self.device)

    def on_validation_epoch_end(self):
        super().on_validation_epoch_end()
        if self._calibration is not None and self.head.config.confidence_head:
            bins = self._calibration
            if self._trainer is not None and self.trainer.world_size > 1:
                bins = self.trainer.strategy.reduce(bins, reduce_op="sum")
            if float(bins[0].sum()):
                self.log("val/ece", expected_calibration_error(bins))
        self._calibration = None
