"""EAGLE-1 and EAGLE-3 training modules."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from draftheads.errors import DraftheadsError
from draftheads.heads import (
    Eagle3Config,
    Eagle3Head,
    EagleConfig,
    EagleHead,
    LayerSpec,
    default_aux_layer_ids,
)
from draftheads.targets import check_layer_ids, decoder_parts
from draftheads.training.data import doc_causal_mask
from draftheads.training.losses import eagle3_loss, eagle_loss, future_mask, shift_left, ttt_scored_positions
from draftheads.training.module import DraftHeadModule

log = logging.getLogger(__name__)


AUX_SCALES = ("median", "rms", "none")
NORM_INITS = ("ones", "target")


def feature_scale(states: torch.Tensor, how: str) -> torch.Tensor:
    """One scale for hidden states [N, H]: the median per-token RMS (``median``), the RMS over all
    tokens (``rms``), or 1 (``none``)."""
    if how == "none" or states.numel() == 0:
        return torch.ones(())
    per_token = states.pow(2).mean(-1)
    value = per_token.median().sqrt() if how == "median" else per_token.mean().sqrt()
    return value.clamp(min=1e-6)


class EagleModule(DraftHeadModule):
    head_type = "eagle"

    def __init__(
        self,
        draft_vocab_size: int | None = None,
        feature_noise: float = 0.2,
        feature_weight: float = 1.0,
        kl_weight: float = 0.1,
        seed: int = 0,
        **kwargs,
    ):
        """
        Args:
            draft_vocab_size: own lm_head over this many frequent tokens (None: the target's lm_head).
            feature_noise: width of the uniform noise added to input features (EAGLE's U(-w/2, w/2)).
            feature_weight: weight of the SmoothL1 feature-regression term.
            kl_weight: weight of the KL term against the target's distribution.
            seed: seed of the feature noise (a function of seed and step, so resumes are exact).
            **kwargs: see :class:`DraftHeadModule`.
        """
        super().__init__(**kwargs)
        self.save_hyperparameters()

    def build_head(self, info, datamodule):
        hp = self.hparams
        head = EagleHead(EagleConfig(layer=LayerSpec.from_hf_config(self.target.config), vocab_size=info.vocab_size,
                                     draft_vocab_size=hp.draft_vocab_size or None))
        if hp.draft_vocab_size:
            self.install_draft_vocab(head, self.build_draft_vocab(datamodule, hp.draft_vocab_size))
        return head

    def compute_loss(self, batch):
        n = self.info.num_layers
        f = self.features(batch, [n])[n]  # [B, T, H]
        x = f
        if self.training and self.hparams.feature_noise > 0:
            g = torch.Generator(device="cpu").manual_seed(self.hparams.seed * 1_000_003 + self.global_step)
            noise = torch.rand(f.shape, generator=g, dtype=torch.float32).to(f.device, f.dtype)
            x = f + (noise - 0.5) * self.hparams.feature_noise
        embeds = self.embed(shift_left(batch["input_ids"], 1)).to(f.dtype)
        mask4d = doc_causal_mask(batch["doc_ids"], dtype=f.dtype)
        pred, _ = self.head(embeds, x, batch["position_ids"], mask=mask4d)
        valid = future_mask(batch["loss_mask"], batch["doc_ids"], 2)
        loss, logs = eagle_loss(
            pred, f, valid, self.head.projection(self.lm_head_weight.to(f.dtype)), self.teacher_weight(f.dtype),
            self.in_head_vocab(self.target_argmax(batch, f)), self.hparams.feature_weight, self.hparams.kl_weight,
            impl=self.hparams.loss_impl, chunk_size=self.hparams.loss_chunk_size,
        )
        acc = logs.pop("acc")
        return loss, logs, [acc]


class Eagle3Module(DraftHeadModule):
    head_type = "eagle3"

    def __init__(
        self,
        aux_layer_ids: list[int] | None = None,
        draft_vocab_size: int | None = None,
        vocab_coverage: float = 0.98,
        draft_vocab_max: int | None = None,
        ttt_steps: int = 7,
        decay: float = 0.8,
        aux_scale: str = "median",
        freeze_lm_head: bool = False,
        intermediate_size: int | None = None,
        norm_init: str = "ones",
        num_layers: int | None = None,
        **kwargs,
    ):
        """
        Args:
            aux_layer_ids: HF hidden-state ids of the three target layers (default (2, L//2, L-3)).
            draft_vocab_size: draft vocabulary size (None: the fewest tokens covering ``vocab_coverage``
                of the validation targets, ranked by the training targets).
            vocab_coverage: fraction of validation target tokens the automatic draft vocabulary covers.
            draft_vocab_max: upper bound of the automatic draft vocabulary size.
            ttt_steps: training-time-test unroll length.
            decay: loss weight of step j is decay**j.
            aux_scale: per-layer scale of the aux states before ``fc``: ``median`` (the median token's RMS,
                blind to attention-sink tokens whose norms are 1e3x the rest) or ``rms`` (RMS over all
                tokens) or ``none``.
            freeze_lm_head: keep the draft lm_head at the target's rows (fewer trained parameters).
            intermediate_size: MLP width of the draft layer (default: the target's). With ``init_head``, a
                larger one widens that head's MLP, the new units starting with no effect on its output, so
                training goes on from the same function with more capacity.
            norm_init: the start of the head's final norm, before its lm_head: ``ones`` or ``target`` (the
                target's own final-norm weights, which its lm_head rows, the draft lm_head's start, are read
                after).
            num_layers: decoder layers of the head (default 1): layer 0 reads (embedding, fused target
                states), the others are Llama layers over its output, as vLLM's EAGLE-3 model stacks them.
                With ``init_head``, more layers than that head's deepen it, each new layer starting as a
                residual that passes its input through, so training goes on from the same function.
            **kwargs: see :class:`DraftHeadModule`.
        """
        super().__init__(**kwargs)
        self.save_hyperparameters()
        if aux_scale not in AUX_SCALES:
            raise DraftheadsError(f"model.aux_scale={aux_scale!r}: use one of {list(AUX_SCALES)}")
        if intermediate_size is not None and intermediate_size < 1:
            raise DraftheadsError(f"model.intermediate_size={intermediate_size} must be >= 1 (or unset: the target's)")
        if num_layers is not None and num_layers < 1:
            raise DraftheadsError(f"model.num_layers={num_layers} must be >= 1 (or unset: 1, or the init_head's)")
        if norm_init not in NORM_INITS:
            raise DraftheadsError(f"model.norm_init={norm_init!r}: use one of {', '.join(NORM_INITS)}")

    def build_head(self, info, datamodule):
        hp = self.hparams
        vocab = self.build_draft_vocab(datamodule, hp.draft_vocab_size, hp.vocab_coverage, hp.draft_vocab_max)
        ids = tuple(hp.aux_layer_ids) if hp.aux_layer_ids else default_aux_layer_ids(info.num_layers)
        check_layer_ids(ids, info.num_layers, "model.aux_layer_ids")
        layer = LayerSpec.from_hf_config(self.target.config)
        if hp.intermediate_size:
            layer = replace(layer, intermediate_size=hp.intermediate_size)
        head = Eagle3Head(Eagle3Config(
            layer=layer, vocab_size=info.vocab_size,
            draft_vocab_size=vocab.size, aux_layer_ids=ids, target_hidden_size=info.hidden_size,
            ttt_steps=hp.ttt_steps, num_layers=hp.num_layers or 1,
        ))
        self.install_draft_vocab(head, vocab)
        with torch.no_grad():
            if hp.aux_scale != "none":
                head.aux_scale.copy_(self._aux_scale(datamodule, ids, hp.aux_scale))
            if hp.norm_init == "target":
                head.norm.weight.copy_(decoder_parts(self.target)[2].weight)
        head.lm_head.weight.requires_grad_(not hp.freeze_lm_head)
        log.warning("aux hidden-state scale (%s, fc input): %s", hp.aux_scale,
                    [round(float(x), 2) for x in head.aux_scale])
        return head

    def _initial_head(self, path: str):
        head = super()._initial_head(path)
        head.lm_head.weight.requires_grad_(not self.hparams.freeze_lm_head)
        width = self.hparams.intermediate_size
        if width and width != head.config.layer.intermediate_size:
            if width < head.config.layer.intermediate_size:
                raise DraftheadsError(
                    f"model.intermediate_size={width} is below the init_head's {head.config.layer.intermediate_size}: "
                    "a head only widens; leave it unset to keep the head's width")
            log.warning("widening the head's MLP from %d to %d units", head.config.layer.intermediate_size, width)
            for layer in head.layers:
                layer.mlp.widen(width)
            head.config.layer = replace(head.config.layer, intermediate_size=width)
        deep = self.hparams.num_layers
        if deep and deep != len(head.layers):
            if deep < len(head.layers):
                raise DraftheadsError(f"model.num_layers={deep} is below the init_head's {len(head.layers)}: a head "
                                      "only deepens; leave it unset to keep the head's layers")
            log.warning("deepening the head from %d to %d decoder layers", len(head.layers), deep)
            head.deepen(deep)
        return head

    @torch.no_grad()
    def _aux_scale(self, datamodule, ids, how: str, batches: int = 4) -> torch.Tensor:
        """Scale of each aux hidden state over a few training batches (real tokens only)."""
        datamodule.setup()
        loader = torch.utils.data.DataLoader(datamodule.train_set, batch_size=datamodule.hparams.batch_size,
                                             collate_fn=datamodule._collate)
        per_layer: list[list[torch.Tensor]] = [[] for _ in ids]
        for n, batch in enumerate(loader):
            if n == batches:
                break
            batch = {k: v.to(self.lm_head_weight.device) for k, v in batch.items()}  # where the target is
            feats = self.features(batch, list(ids))
            real = batch["doc_ids"] >= 0
            for i, layer in enumerate(ids):
                per_layer[i].append(feats[layer][real].float().cpu())
        return torch.stack([feature_scale(torch.cat(x), how) for x in per_layer])

    def compute_loss(self, batch):
        cfg = self.head.config
        n = self.info.num_layers
        feats = self.features(batch, sorted(set(cfg.aux_layer_ids) | {n}))
        aux = torch.cat([feats[i] for i in cfg.aux_layer_ids], -1)
        last = feats[n]
        ids = batch["input_ids"]
        prefix_mask = doc_causal_mask(batch["doc_ids"], dtype=aux.dtype)
        want = self.in_head_vocab(self.target_argmax(batch, last))
        keep = ttt_scored_positions(batch["loss_mask"], batch["doc_ids"], want, cfg.ttt_steps)
        outs = self.head.ttt(
            aux, lambda j: self.embed(shift_left(ids, 1 + j)).to(aux.dtype), batch["position_ids"], prefix_mask,
            keep=keep,
        )
        loss, per_step, accs = eagle3_loss(
            outs, last, batch["loss_mask"], batch["doc_ids"], self.head.lm_head.weight, self.teacher_weight(last.dtype),
            want, decay=self.hparams.decay, impl=self.hparams.loss_impl, chunk_size=self.hparams.loss_chunk_size,
        )
        return loss, {f"loss_{j + 1}": v for j, v in enumerate(per_step)}, accs
