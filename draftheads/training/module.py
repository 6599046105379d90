"""Shared wiring of the per-family LightningModules: frozen target + head + loss, no math of its own.

The target is built in ``configure_model`` (so strategies place or shard it), kept in eval mode, out of
the optimizer and out of checkpoints; checkpoints hold the head's weights and the optimizer state.
At the end of ``fit`` rank 0 writes a standalone head directory (``head_dir``).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time

import lightning as L
import torch

from draftheads.errors import DraftheadsError
from draftheads.heads import check_head_fits_target, load_head
from draftheads.heads.base import HEAD_FILES, save_head_dir
from draftheads.heads.vocab import DraftVocab, build_draft_vocab
from draftheads.kernels.linear_argmax import linear_argmax
from draftheads.metrics import simulated_tau
from draftheads.targets import freeze, hidden_states, load_target
from draftheads.training.data import answer_window, doc_causal_mask
from draftheads.training.losses import IMPLS
from draftheads.utils import check_output_dir

log = logging.getLogger(__name__)


def _mean_per_step(hits: list[list[float]]) -> list[float]:
    """Per-step means over validation batches of their per-step accuracies (NaN: no position)."""
    means = []
    for j in range(max(len(a) for a in hits)):
        vals = [a[j] for a in hits if j < len(a) and not math.isnan(a[j])]
        means.append(sum(vals) / len(vals) if vals else 0.0)
    return means


def state_dict_without(module: torch.nn.Module, child: str, state_dict, *args, **kwargs) -> dict:
    """``state_dict(*args, **kwargs)`` (``module``'s own bound method) with the submodule ``child`` left
    out: its ``state_dict`` and hooks never run, so under FSDP its parameters are never unsharded."""
    modules = module._modules
    module.__dict__["_modules"] = {k: v for k, v in modules.items() if k != child}
    try:
        return state_dict(*args, **kwargs)
    finally:
        module.__dict__["_modules"] = modules


def warmup_cosine(step: int, total: int, warmup_ratio: float, floor: float, restarts: int = 0) -> float:
    """Learning-rate factor: linear warmup over ``warmup_ratio`` of ``total`` steps, then cosine to ``floor``;
    with ``restarts``, the ``total`` steps run that many more equal cycles, each warmed up to the peak again
    (warm restarts)."""
    if restarts:  # the step within its cycle (the last cycle runs on past the end, at the floor)
        total = max(total // (restarts + 1), 1)
        step -= total * min(step // total, restarts)
    warm = int(round(warmup_ratio * total))
    if step < warm:
        return (step + 1) / warm
    progress = min((step - warm) / max(total - warm, 1), 1.0)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class DraftHeadModule(L.LightningModule):
    """Base class; subclasses define ``build_head``, ``feature_layer_ids`` and ``compute_loss``."""

    head_type = ""

    def __init__(
        self,
        target: str = "smollm2-135m",
        target_dtype: str = "float32",
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_ratio: float = 0.03,
        min_lr_ratio: float = 0.1,
        head_dir: str | None = None,
        init_head: str | None = None,
        loss_impl: str = "auto",
        loss_chunk_size: int = 1024,
        val_answer_window: int = 128,
        train_answer_window: int = 0,
        lr_restarts: int = 0,
        trust_remote_code: bool = False,
    ):
        """
        Args:
            target: target spec (``smollm2-135m``, a model directory, a .gguf file or a hub id).
            target_dtype: dtype of the frozen target (float32, bfloat16, float16).
            lr: peak learning rate of AdamW.
            weight_decay: AdamW weight decay.
            betas: AdamW betas.
            warmup_ratio: fraction of the optimizer steps spent in linear warmup, then cosine decay to
                ``min_lr_ratio * lr``.
            min_lr_ratio: final learning rate as a fraction of ``lr``.
            head_dir: where the standalone head directory is written at the end of fit.
            init_head: a head directory (or ``reference``) of this family to start from instead of a new
                head: training goes on from its weights with a fresh optimizer and schedule (more epochs
                for a trained head, or an imported public head fine-tuned on this data). Its config and
                draft vocabulary are kept, so the family's options that shape a new head are not used.
            loss_impl: ``auto`` (Liger on CUDA, chunked torch elsewhere), ``liger``, ``chunked`` or
                ``compiled`` (chunked, each chunk's softmax arithmetic fused by torch.compile: faster on
                CPU, after a compile of some seconds at the first step).
            loss_chunk_size: rows per chunk of the chunked loss.
            val_answer_window: validation also reports the accuracies over the first this many tokens of
                each answer, the part a ``--max-new-tokens`` evaluation of that length drafts for (long
                answers end in repetitive text a draft predicts easily, which lifts the overall figure);
                0 turns it off.
            train_answer_window: training scores only the first this many tokens of each answer (0: every
                answer token), the part an evaluation of that length drafts for.
            lr_restarts: the schedule's steps run in this many more equal cycles, each warmed up to ``lr``
                and decayed again (warm restarts; 0: one schedule).
            trust_remote_code: allow custom modeling code for hub targets.
        """
        super().__init__()
        self.save_hyperparameters()
        if lr <= 0:
            raise DraftheadsError(f"model.lr={lr} must be > 0")
        if not 0 <= warmup_ratio < 1:
            raise DraftheadsError(f"model.warmup_ratio={warmup_ratio} must be in [0, 1)")
        if loss_impl not in IMPLS:
            raise DraftheadsError(f"model.loss_impl={loss_impl!r}: use one of {', '.join(IMPLS)}")
        if loss_impl == "compiled" and not torch.cuda.is_available() and not any(
                shutil.which(c) for c in (os.environ.get("CXX", "g++"), "c++", "clang++")):
            raise DraftheadsError("model.loss_impl=compiled needs a C++ compiler for torch.compile on CPU (none of "
                                  "$CXX, g++, c++, clang++ found): install one, or use model.loss_impl: chunked")
        if val_answer_window < 0:
            raise DraftheadsError(f"model.val_answer_window={val_answer_window} must be >= 0 (0: off)")
        if train_answer_window < 0:
            raise DraftheadsError(f"model.train_answer_window={train_answer_window} must be >= 0 (0: every answer token)")
        if lr_restarts < 0:
            raise DraftheadsError(f"model.lr_restarts={lr_restarts} must be >= 0 (0: one schedule)")
        if head_dir:  # checked now, not after the training it would end
            check_output_dir(head_dir, "head", names=HEAD_FILES, flag="model.head_dir",
                             fix="delete it first to replace it")
        self.target: torch.nn.Module | None = None
        self.head: torch.nn.Module | None = None
        self.info = None
        self.strict_loading = False  # checkpoints hold no target weights
        self._tokens_seen = 0
        self._t0 = None

    # ------------------------------------------------------------------ building

    def configure_model(self) -> None:
        if self.target is not None:
            return
        loaded = load_target(  # on this rank's device, so the statistics heads take at build time run there
            self.hparams.target, dtype=self.hparams.target_dtype, device=self._rank_device(),
            trust_remote_code=self.hparams.trust_remote_code,
        )
        self.target = freeze(loaded.model)
        self.info = loaded.info
        if self.head is None and self.hparams.init_head:
            self.head = self._initial_head(self.hparams.init_head)
        elif self.head is None:
            dm = self.trainer.datamodule if self._trainer is not None else None
            self.head = self.build_head(self.info, dm)
        check_head_fits_target(self.head, self.info)

    def _initial_head(self, path: str) -> torch.nn.Module:
        head, meta = load_head(path)
        if meta["head_type"] != self.head_type:
            raise DraftheadsError(f"model.init_head {path} is a {meta['head_type']} head but this module trains "
                                  f"{self.head_type} heads: start from a {self.head_type} head, or train it with "
                                  "its own family's module")
        log.warning("starting from the %s head in %s", meta["head_type"], path)
        if meta.get("draft_vocab_coverage"):  # it keeps that head's draft vocabulary, built from its data
            self.draft_vocab_coverage = meta["draft_vocab_coverage"]
        return head.float().to(self._rank_device()).train()

    def _rank_device(self) -> torch.device:
        """The device this process trains on (the strategy's root device; CPU without a trainer)."""
        trainer = self._trainer
        return trainer.strategy.root_device if trainer is not None else torch.device("cpu")

    def build_head(self, info, datamodule):  # pragma: no cover - abstract
        raise NotImplementedError

    def train(self, mode: bool = True):
        super().train(mode)
        if self.target is not None:
            self.target.eval()  # the target never leaves eval mode
        return self

    # ------------------------------------------------------------------ target access

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.target.get_output_embeddings().weight

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.target.get_input_embeddings()(ids)

    def features(self, batch: dict, layer_ids) -> dict[int, torch.Tensor]:
        """Target hidden states at ``layer_ids``: from the batch (offline cache) or a target forward."""
        cached = {i: batch[f"feat_{i}"] for i in layer_ids if f"feat_{i}" in batch}
        if len(cached) == len(layer_ids):
            return {i: cached[i].to(self.head_dtype) for i in layer_ids}
        have = sorted(int(k[5:]) for k in batch if k.startswith("feat_"))
        if have:  # an offline cache without some layer this head reads: not silently run the target instead
            raise DraftheadsError(f"the feature cache holds layers {have} but this head reads {sorted(layer_ids)}: "
                                  "write the cache with these layers (e.g. --features eagle3), or train without "
                                  "data.feature_dir")
        mask = doc_causal_mask(batch["doc_ids"], dtype=self.target_dtype)
        with torch.no_grad():
            feats, _ = hidden_states(
                self.target, batch["input_ids"], layer_ids, attention_mask=mask, position_ids=batch["position_ids"]
            )
        return {i: f.to(self.head_dtype) for i, f in feats.items()}

    def target_argmax(self, batch: dict, last: torch.Tensor) -> torch.Tensor:
        """[B, T] target's greedy next token at each position (cached offline, or from ``last``)."""
        if "target_argmax" in batch:
            return batch["target_argmax"]
        flat = linear_argmax(last.reshape(-1, last.shape[-1]), self.lm_head_weight.to(last.dtype))
        return flat.view(last.shape[:2])

    # ------------------------------------------------------------------ draft vocabulary

    def build_draft_vocab(self, datamodule, size: int | None, coverage: float = 0.98,
                          max_size: int | None = None) -> DraftVocab:
        """The draft vocabulary, ranked by the training targets; sized (when ``size`` is None) to cover
        ``coverage`` of the validation targets, so it is judged on text it was not built from."""
        v = self.info.vocab_size
        vocab = build_draft_vocab(datamodule.token_counts(v), size=size, coverage=coverage,
                                  held_out=datamodule.token_counts(v, split="val"),
                                  tie_break=datamodule.token_counts(v, masked=False), max_size=max_size)
        held = "n/a (no validation split)" if vocab.held_out_coverage is None else f"{100 * vocab.held_out_coverage:.1f}%"
        log.warning("draft vocabulary: %d tokens covering %.1f%% of training and %s of validation target tokens",
                    vocab.size, 100 * vocab.coverage, held)
        self.draft_vocab_coverage = {"train": vocab.coverage, "val": vocab.held_out_coverage}
        return vocab

    @torch.no_grad()
    def install_draft_vocab(self, head, vocab: DraftVocab) -> None:
        """The head's ``d2t`` (and ``t2d`` where it has one) from ``vocab``, its lm_head started at the
        target's rows of those tokens."""
        head.d2t.copy_(vocab.d2t)
        if hasattr(head, "t2d"):
            head.t2d.copy_(vocab.t2d)
        head.lm_head.weight.copy_(self.lm_head_weight[vocab.draft_ids].float())

    def draft_ids(self) -> torch.Tensor | None:
        """Target ids of the head's draft vocabulary in its order, or None (the full vocabulary)."""
        if getattr(self.head.config, "draft_vocab_size", None):
            return torch.arange(self.head.d2t.numel(), device=self.head.d2t.device) + self.head.d2t
        return None

    def in_head_vocab(self, ids: torch.Tensor, missing: int = -1) -> torch.Tensor:
        """Target token ids as indices of the head's vocabulary (``missing`` where the draft vocabulary lacks one)."""
        draft = self.draft_ids()
        if draft is None:
            return ids
        lookup = torch.full((self.info.vocab_size,), missing, dtype=torch.long, device=ids.device)
        lookup[draft.to(ids.device)] = torch.arange(draft.numel(), device=ids.device)
        return lookup[ids]

    def teacher_weight(self, dtype) -> torch.Tensor:
        """The target's lm_head rows of the head's vocabulary: the teacher's distribution is the target's
        restricted to the tokens the head can draft."""
        w = self.lm_head_weight.to(dtype)
        ids = self.draft_ids()
        return w[ids] if ids is not None else w

    @property
    def head_dtype(self) -> torch.dtype:
        return next(self.head.parameters()).dtype if self.head is not None else torch.float32

    @property
    def target_dtype(self) -> torch.dtype:
        return next(self.target.parameters()).dtype

    # ------------------------------------------------------------------ steps

    def compute_loss(self, batch: dict) -> tuple[torch.Tensor, dict, list[float]]:  # pragma: no cover
        """(loss, scalar logs, per-position top-1 accuracies)."""
        raise NotImplementedError

    def training_step(self, batch, batch_idx):
        if self._t0 is None:
            self._t0 = time.perf_counter()
        if n := self.hparams.train_answer_window:
            batch = {**batch, "loss_mask": answer_window(batch["loss_mask"], batch["doc_ids"], n)}
        loss, logs, accs = self.compute_loss(batch)
        if not torch.isfinite(loss):
            ckpt = getattr(self.trainer.checkpoint_callback, "last_model_path", "") or "none yet"
            raise DraftheadsError(
                f"training loss is {loss.item()} at step {self.global_step}: stopped; last good checkpoint: "
                f"{ckpt}; lower model.lr or check the data"
            )
        self._tokens_seen += int(batch["input_ids"].numel())
        tok_s = self._tokens_seen / max(time.perf_counter() - self._t0, 1e-9)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/tok_s", tok_s, prog_bar=True)
        for k, v in logs.items():
            self.log(f"train/{k}", v)
        for j, a in enumerate(accs):
            if not math.isnan(a):
                self.log(f"train/acc_{j + 1}", a)
        sched = self.lr_schedulers()
        if sched is not None:
            self.log("train/lr", sched.get_last_lr()[0])
        return loss

    def on_validation_epoch_start(self):
        self._val_hits: list[list[float]] = []
        self._val_window_hits: list[list[float]] = []

    def validation_step(self, batch, batch_idx):
        loss, _, accs = self.compute_loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self._val_hits.append(accs)
        if n := self.hparams.val_answer_window:
            windowed = {**batch, "loss_mask": answer_window(batch["loss_mask"], batch["doc_ids"], n)}
            self._val_window_hits.append(self.compute_loss(windowed)[2])

    def on_validation_epoch_end(self):
        if not self._val_hits:
            return
        means = _mean_per_step(self._val_hits)
        for j, m in enumerate(means):
            self.log(f"val/acc_{j + 1}", m, sync_dist=True)
        self.log("val/sim_tau", simulated_tau(means), prog_bar=True, sync_dist=True)
        self.last_val_accuracies = means
        if self._val_window_hits:
            n = self.hparams.val_answer_window
            window = _mean_per_step(self._val_window_hits)
            for j, m in enumerate(window):
                self.log(f"val/acc{n}_{j + 1}", m, sync_dist=True)
            self.log(f"val/sim_tau{n}", simulated_tau(window), sync_dist=True)
            self.last_val_window_accuracies = window

    # ------------------------------------------------------------------ optimisation

    def configure_optimizers(self):
        params = [p for p in self.head.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.hparams.lr, betas=tuple(self.hparams.betas),
                                weight_decay=self.hparams.weight_decay)
        total = max(int(self.trainer.estimated_stepping_batches), 1)

        def factor(step: int) -> float:
            return warmup_cosine(step, total, self.hparams.warmup_ratio, self.hparams.min_lr_ratio,
                                 self.hparams.lr_restarts)

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ------------------------------------------------------------------ checkpoints and export

    def state_dict(self, *args, **kwargs) -> dict:
        """Everything but the frozen target, which reloads from its own weights: checkpoints hold what
        training changes, and FSDP's full-state gather (checkpoints, :meth:`on_fit_end`) never copies a
        target to rank 0."""
        return state_dict_without(self, "target", super().state_dict, *args, **kwargs)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        from draftheads.training.fsdp import clip_grad_norm, is_fsdp

        if gradient_clip_val and is_fsdp(self.trainer.strategy) and gradient_clip_algorithm in (None, "norm"):
            clip_grad_norm(self.trainer.strategy, gradient_clip_val)  # the norm over every rank's shards
            return
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                            gradient_clip_algorithm=gradient_clip_algorithm)

    def on_fit_end(self) -> None:
        if not self.hparams.head_dir:
            return
        from draftheads.training.fsdp import full_state_dict

        state = full_state_dict(self.trainer.strategy)  # every rank: a collective under FSDP
        if self.trainer.is_global_zero:
            head_state = {k[len("head."):]: v for k, v in state.items() if k.startswith("head.")}
            extra = {"target": self.hparams.target}
            if getattr(self, "last_val_accuracies", None):
                extra["val_accuracies"] = self.last_val_accuracies
                extra["val_sim_tau"] = simulated_tau(self.last_val_accuracies)
            if getattr(self, "last_val_walk", None):  # set by the WalkedTau callback, when it walks
                extra["val_walk_tau"] = self.last_val_walk
            if getattr(self, "last_val_window_accuracies", None):
                extra["val_answer_window"] = self.hparams.val_answer_window
                extra["val_window_accuracies"] = self.last_val_window_accuracies
                extra["val_window_sim_tau"] = simulated_tau(self.last_val_window_accuracies)
            if getattr(self, "draft_vocab_coverage", None):
                extra["draft_vocab_coverage"] = self.draft_vocab_coverage
            save_head_dir(self.hparams.head_dir, self.head.head_type, self.head.config, head_state, extra)
            log.warning("head written to %s", self.hparams.head_dir)
