"""DFlash training: many blocks per packed row, each anchored inside an assistant span, in one forward.

For a row with target features, ``anchors_per_row`` anchor positions a are drawn among the positions
whose next token is trained (``loss_mask[a + 1]``); block j is ``[x_a, MASK, ...]`` at a .. a + B - 1
and sees its document's context before a (:func:`~draftheads.heads.dflash.block_attention_mask`, taken
tile by tile, or its FlexAttention form on CUDA). The mask at a + k is trained towards the target's own next-token distribution at a + k - 1 (KL, teacher
logits computed only at those positions) or its token (``loss: ce``), weighted by exp(-(k - 1) / B),
over the target's full vocabulary through its frozen lm_head, or over a draft vocabulary through the
head's own lm_head (``draft_vocab_size``; the teacher restricted to it), with the chunked/Liger fused losses.
Anchors are drawn from a generator seeded by the step in training (a resumed run draws the same) and
by the batch in validation (epochs are compared on the same blocks); ``val/acc_k`` is the top-1 agreement with the target at block position k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from draftheads.errors import DraftheadsError
from draftheads.heads import DFlashHead, LayerSpec
from draftheads.heads.dflash import BLOCK_MASKS, default_target_layer_ids
from draftheads.kernels.linear_argmax import linear_argmax
from draftheads.targets import check_layer_ids
from draftheads.training.losses import (
    IGNORE_INDEX,
    linear_cross_entropy,
    linear_kl,
    linear_token_nll,
)
from draftheads.training.module import DraftHeadModule

LOSSES = ("kl", "ce")
POSITION_WEIGHTINGS = ("decay", "dpace")


def position_weight(j: int, block_size: int) -> float:
    """Weight of the j-th draft of a block (1-based): exp(-(j - 1) / block_size)."""
    return math.exp(-(j - 1) / block_size)


def dpace_weights(confidence: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE per-position weights [..., L] of the blocks' drafts (arXiv 2605.18810): with the draft's
    confidence in the data's token q_i = exp(-CE_i), smoothed q~_i = (1 - alpha) q_i + alpha, position j
    weighs w_j = sum_{m >= j, valid} prod_{i <= m} q~_i, its chance to be reached times the accepted length
    it can still add. Positions outside ``valid`` neither weigh nor interrupt the product. No gradient."""
    q = torch.where(valid, (1 - alpha) * confidence.detach() + alpha, torch.ones_like(confidence))
    reach = torch.cumprod(q, -1) * valid
    return torch.flip(torch.cumsum(torch.flip(reach, [-1]), -1), [-1]) * valid


@dataclass
class Blocks:
    """One step's blocks: head outputs and, per slot, the row position it predicts."""

    out: torch.Tensor  # [B, N, blk, H] normed head outputs
    pred: torch.Tensor  # [B, N, blk] row position each slot predicts (clamped inside the row)
    valid: torch.Tensor  # [B, N, blk] bool: the slot drafts and its position is a trained token of the anchor's document
    last: torch.Tensor  # [B, T, H_target] the target's final hidden states (its distribution at t predicts t + 1)
    argmax: torch.Tensor  # [B, T] the target's greedy next token at each position

    @staticmethod
    def draft_slots(cfg) -> list[tuple[int, int]]:
        """(draft index j from 1, block slot k) of every drafting slot."""
        return [(k - cfg.first_draft_slot + 1, k) for k in range(cfg.first_draft_slot, cfg.block_size)]

    def rows(self, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Slot k's valid blocks: head outputs [n, H], their batch rows [n] and predicted positions [n]."""
        m = self.valid[:, :, k]
        return self.out[:, :, k][m], torch.nonzero(m)[:, 0], self.pred[:, :, k][m]


def sample_anchors(loss_mask: torch.Tensor, doc_ids: torch.Tensor, n: int, generator=None) -> torch.Tensor:
    """[B, n] anchor positions (ascending; -1 where a row has fewer candidates): positions a whose next
    token is trained and in the same document."""
    b, t = loss_mask.shape
    ok = torch.zeros(b, t, dtype=torch.bool, device=loss_mask.device)
    ok[:, :-1] = loss_mask[:, 1:].bool() & (doc_ids[:, 1:] == doc_ids[:, :-1]) & (doc_ids[:, :-1] >= 0)
    out = torch.full((b, n), -1, dtype=torch.long, device=loss_mask.device)
    for r in range(b):
        cand = ok[r].nonzero().flatten()
        if cand.numel():
            pick = torch.randperm(cand.numel(), generator=generator)[:n].to(cand.device)
            chosen = cand[pick].sort().values
            out[r, : chosen.numel()] = chosen
    return out


class DFlashModule(DraftHeadModule):
    head_type = "dflash"
    head_class = DFlashHead

    def __init__(
        self,
        target_layer_ids: list[int] | None = None,
        num_layers: int = 1,
        block_size: int = 16,
        anchors_per_row: int = 32,
        mask_token_id: int | None = None,
        causal: bool = False,
        sliding_window: int | None = None,
        loss: str = "kl",
        position_weighting: str = "decay",
        dpace_alpha: float = 0.5,
        attention: str = "tiles",
        draft_vocab_size: int | None = None,
        seed: int = 0,
        **kwargs,
    ):
        """
        Args:
            target_layer_ids: HF hidden-state ids of the target layers forming the context (default: the
                EAGLE-3 layers (2, L//2, L-3), so one feature cache serves both families).
            num_layers: draft decoder layers (1-5).
            block_size: tokens per block (the anchor and block_size - 1 masks); serve with
                num_speculative_tokens = block_size - 1.
            anchors_per_row: blocks trained per packed row per step.
            mask_token_id: the id exports name for the mask (default: a special token of the tokenizer
                that never occurs in the training data); the mask's embedding is learned.
            causal: causal attention within a block.
            sliding_window: context positions a block sees, back from its anchor (None = all).
            loss: ``kl`` (to the target's distribution) or ``ce`` (to the data's tokens).
            position_weighting: ``decay`` (draft j weighs exp(-(j - 1) / block_size)) or ``dpace`` (weights
                from the draft's own confidence, :func:`dpace_weights`; needs ``loss: ce``).
            dpace_alpha: D-PACE's confidence smoothing, in (0, 1].
            attention: how blocks are masked: ``tiles`` (tiles of whole blocks, one SDPA each over the
                context span its blocks see), ``sdpa`` (one SDPA under a dense [Q, T + Q] mask) or ``flex`` (a
                FlexAttention block mask, compiled; CUDA only, as FlexAttention has no CPU backward). All
                three give the same loss and gradients. On 2 CPU threads, 4 rows of 1,024 tokens, bf16, a
                step with tiles ran 1.09x (128 anchors) to 1.36x (512) as fast as with the dense mask
                (``scripts/bench_train_step.py --parts blocks``); on an H200 at 4 rows of 2,048 tokens, 128
                anchors, block 8, ``flex`` and ``sdpa`` gave the same step time and memory
                (``scripts/gpu_check.sh``, docs/gpu.md).
            draft_vocab_size: an own lm_head over this many most frequent training targets (``d2t``),
                started at the target's rows and trained, the teacher restricted to them (as EAGLE-3's);
                None: the target's frozen lm_head over the full vocabulary.
            seed: seed of the anchor draws (a function of seed and step, so resumes are exact).
            **kwargs: see :class:`DraftHeadModule`.
        """
        super().__init__(**kwargs)
        self.save_hyperparameters()
        if loss not in LOSSES:
            raise DraftheadsError(f"model.loss={loss!r}: use one of {list(LOSSES)}")
        if anchors_per_row < 1:
            raise DraftheadsError(f"model.anchors_per_row={anchors_per_row} must be >= 1")
        if position_weighting not in POSITION_WEIGHTINGS:
            raise DraftheadsError(f"model.position_weighting={position_weighting!r}: use one of "
                                  f"{list(POSITION_WEIGHTINGS)}")
        if position_weighting == "dpace" and loss != "ce":
            raise DraftheadsError("model.position_weighting=dpace weighs cross-entropy terms: set model.loss: ce")
        if not 0 < dpace_alpha <= 1:
            raise DraftheadsError(f"model.dpace_alpha={dpace_alpha} must be in (0, 1]")
        if draft_vocab_size is not None and draft_vocab_size < 1:
            raise DraftheadsError(f"model.draft_vocab_size={draft_vocab_size} must be >= 1, or null for the full vocabulary")
        if attention not in BLOCK_MASKS:
            raise DraftheadsError(f"model.attention={attention!r}: use one of {list(BLOCK_MASKS)}")

    def build_head(self, info, datamodule):
        hp = self.hparams
        ids = tuple(hp.target_layer_ids) if hp.target_layer_ids else default_target_layer_ids(info.num_layers)
        check_layer_ids(ids, info.num_layers - 1, "model.target_layer_ids")
        mask_id = self._mask_token_id(info, datamodule)
        head = self.head_class(self.head_class.config_type(
            layer=LayerSpec.from_hf_config(self.target.config), vocab_size=info.vocab_size, target_layer_ids=ids,
            mask_token_id=mask_id, num_layers=hp.num_layers, block_size=hp.block_size,
            target_hidden_size=info.hidden_size, causal=hp.causal, sliding_window=hp.sliding_window,
            draft_vocab_size=hp.draft_vocab_size, **self.extra_config(),
        ))
        with torch.no_grad():  # start the mask where the token it stands for sits
            head.mask_embedding.copy_(self.target.get_input_embeddings().weight[mask_id].float())
        if hp.draft_vocab_size is not None:
            self.install_draft_vocab(head, self.build_draft_vocab(datamodule, hp.draft_vocab_size))
        return head

    def extra_config(self) -> dict:
        """Config fields of a subclass's head beyond DFlash's."""
        return {}

    def _mask_token_id(self, info, datamodule) -> int:
        """The given id, checked against the data, or the last special token the data never uses."""
        counts = datamodule.token_counts(info.vocab_size, masked=False) if datamodule is not None else None
        used = set(counts.nonzero().flatten().tolist()) if counts is not None else set()
        mask_id = self.hparams.mask_token_id
        if mask_id is not None:
            if not 0 <= mask_id < info.vocab_size:
                raise DraftheadsError(f"model.mask_token_id={mask_id} is outside the vocabulary (0..{info.vocab_size - 1})")
            if mask_id in used:
                raise DraftheadsError(f"model.mask_token_id={mask_id} occurs in the training data as a real token: "
                                      "choose a special token the data never uses")
            return mask_id
        from draftheads.targets import load_tokenizer

        tok = load_tokenizer(self.hparams.target, trust_remote_code=self.hparams.trust_remote_code)
        free = [i for i in sorted(set(tok.all_special_ids)) if i not in used and i < info.vocab_size]
        if not free:
            raise DraftheadsError("no special token of the tokenizer is free for the mask: set model.mask_token_id "
                                  "to an id the training data never uses")
        return free[-1]

    def block_mask(self, device: torch.device):
        """The mask builder of ``model.attention`` on ``device``."""
        name = self.hparams.attention
        if name == "flex" and device.type != "cuda" and torch.is_grad_enabled():
            raise DraftheadsError("model.attention=flex trains on CUDA only (FlexAttention has no backward on "
                                  f"{device.type}): use sdpa")
        return BLOCK_MASKS[name]

    def block_forward(self, batch) -> Blocks:
        """The step's anchors drawn and all their blocks run in one head forward."""
        cfg = self.head.config
        n = self.info.num_layers
        feats = self.features(batch, sorted(set(cfg.target_layer_ids) | {n}))
        ids, pos, docs = batch["input_ids"], batch["position_ids"], batch["doc_ids"]
        # training: a function of the step (resumes draw the same blocks); validation: of the batch (every
        # epoch is measured on the same blocks)
        key = self.hparams.seed * 1_000_003 + self.global_step if self.training else int(ids.sum())
        gen = torch.Generator().manual_seed(key % (1 << 62))
        anchors = sample_anchors(batch["loss_mask"], docs, self.hparams.anchors_per_row, gen)
        bsz, t = ids.shape
        blk = cfg.block_size
        ctx = self.head.context(torch.cat([feats[i] for i in cfg.target_layer_ids], -1))
        kv = self.head.context_kv(ctx, pos)
        a = anchors.clamp(min=0)
        block = self.head.block_inputs(self.embed(ids.gather(1, a)).to(ctx.dtype))
        offsets = torch.arange(blk, device=ids.device)
        qpos = (pos.gather(1, a)[:, :, None] + offsets).reshape(bsz, -1)
        mask = self.block_mask(ids.device)(anchors, docs, blk, cfg.causal, cfg.sliding_window)
        out = self.head(block, qpos, kv, mask).view(bsz, -1, blk, ctx.shape[-1])  # [B, N, blk, H]

        pred = a[:, :, None] + offsets + (1 - cfg.first_draft_slot)  # [B, N, blk] row position each slot predicts
        inside = (anchors[:, :, None] >= 0) & (pred < t)
        pred = pred.clamp(max=t - 1)
        same_doc = docs.gather(1, pred.flatten(1)).view_as(pred) == docs.gather(1, a)[:, :, None]
        trained = batch["loss_mask"].gather(1, pred.flatten(1)).view_as(pred).bool()
        valid = inside & same_doc & trained
        valid[:, :, : cfg.first_draft_slot] = False
        return Blocks(out, pred, valid, feats[n], self.target_argmax(batch, feats[n]))

    def compute_loss(self, batch):
        hp, cfg = self.hparams, self.head.config
        b = self.block_forward(batch)
        ids = batch["input_ids"]
        w_student = self.head.projection(self.lm_head_weight).to(b.out.dtype)
        w_teacher = self.teacher_weight(b.last.dtype)
        chunk = hp.loss_chunk_size
        labels = self.in_head_vocab(ids, IGNORE_INDEX)  # the head's classes of the row's tokens
        dpace = self._dpace_weights(b, labels, w_student) if hp.position_weighting == "dpace" else None
        total = b.out.new_zeros((), dtype=torch.float32)
        logs, accs = {}, []
        for j, k in b.draft_slots(cfg):
            m = b.valid[:, :, k]
            if not m.any():
                accs.append(float("nan"))
                total = total + b.out.sum() * 0.0  # keep every parameter in the graph (DDP)
                continue
            hs, rows, pred = b.rows(k)
            want = b.argmax[rows, pred - 1]
            if hp.loss == "kl":
                lk = linear_kl(hs, w_student, b.last[rows, pred - 1], w_teacher, impl=hp.loss_impl, chunk_size=chunk)
            else:
                lk = linear_cross_entropy(hs, w_student, labels[rows, pred], impl=hp.loss_impl,
                                          chunk_size=chunk, row_weights=None if dpace is None else dpace[:, :, k][m])
            total = total + (position_weight(j, cfg.block_size) if dpace is None else 1.0) * lk
            logs[f"loss_{j}"] = lk.detach()
            top = self.head.to_target_ids(linear_argmax(hs.detach(), w_student.detach()))
            accs.append((top == want).float().mean().item())
        return total, logs, accs

    @torch.no_grad()
    def _dpace_weights(self, b: Blocks, labels: torch.Tensor, w_student: torch.Tensor) -> torch.Tensor:
        """[B, N, blk] D-PACE weights from the draft's confidence in each predicted token, ``labels`` [B, T] the
        head's classes of the row's tokens (no gradient)."""
        conf = torch.zeros(b.valid.shape, dtype=torch.float32, device=b.out.device)
        for _, k in Blocks.draft_slots(self.head.config):
            m = b.valid[:, :, k]
            if m.any():
                hs, rows, pred = b.rows(k)
                want = labels[rows, pred]
                known = want != IGNORE_INDEX  # a token outside the draft vocabulary: confidence 0
                nll = linear_token_nll(hs.detach(), w_student.detach(), want.clamp(min=0),
                                       self.hparams.loss_chunk_size)
                conf[:, :, k][m] = torch.where(known, torch.exp(-nll), torch.zeros_like(nll))
        return dpace_weights(conf, b.valid, self.hparams.dpace_alpha)
