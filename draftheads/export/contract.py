"""The serving contract of an export, checked against its target without vLLM.

vLLM loads a draft whose fields disagree with its target or with how it was trained, and then accepts
almost nothing, with no error. These are the fields where that has happened in the field: the layer ids
(each format counts them its own way), the block size against the number of speculative tokens, the mask
token, the draft vocabulary maps, the fc input's normalisation, and the vocabulary and hidden sizes.
:func:`check_contract` stops at the first wrong one with one line naming it.

Layer-id conventions, in HF hidden-state ids (0 = the embeddings, i = the output of layer i):

* EAGLE-3 (``vllm-eagle3``, ``speculators``): ``eagle_aux_hidden_state_layer_ids`` are the states vLLM
  collects entering layer i, i.e. HF id i; vLLM collects them for 0 <= i < num_layers only.
* DFlash / DSpark (``vllm-dflash``, ``vllm-dspark``): ``dflash_config.target_layer_ids`` are the outputs of
  layer i, i.e. HF id i + 1; valid for 0 <= i < num_layers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from draftheads.errors import DraftheadsError


@dataclass(frozen=True)
class TargetShape:
    """What an export must agree with in its target."""

    num_layers: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def of(cls, model) -> TargetShape:
        cfg = model.config.get_text_config()
        vocab = model.get_output_embeddings().weight.shape[0]
        return cls(cfg.num_hidden_layers, cfg.hidden_size, vocab)


def hf_layer_ids(fmt: str, cfg: dict) -> list[int]:
    """The export's layer ids as HF hidden-state ids (see the module docstring)."""
    from draftheads.export.vllm import EXPORTS

    kind = EXPORTS[fmt].head_type
    if kind == "eagle3":
        return list(cfg["eagle_aux_hidden_state_layer_ids"])
    if kind in ("dflash", "dspark"):
        return [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]]
    return []


def check_contract(path: str | os.PathLike, fmt: str, target: TargetShape, k: int | None = None,
                   head_config=None) -> None:
    """The export at ``path`` in ``fmt`` against ``target``, served with ``k`` speculative tokens (when
    known) and made from a head of ``head_config`` (when known: its layer ids must survive the format's
    convention). Raises :class:`DraftheadsError` naming the first field that breaks the contract."""
    from draftheads.export.vllm import EXPORTS

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    kind = EXPORTS[fmt].head_type

    def fail(field: str, problem: str):
        raise DraftheadsError(f"export {path} ({fmt}): {field} {problem}")

    layer = cfg.get("transformer_layer_config", cfg)  # speculators nests the draft layer's config
    if layer.get("vocab_size") is not None and layer["vocab_size"] != target.vocab_size:
        fail("vocab_size", f"{layer['vocab_size']} is not the target's {target.vocab_size}: train the head on this "
                           "target's tokenizer")
    hidden = cfg.get("target_hidden_size", cfg.get("hidden_size") if kind in ("eagle", "medusa") else None)
    if hidden is not None and hidden != target.hidden_size:
        fail("target_hidden_size" if "target_hidden_size" in cfg else "hidden_size",
             f"{hidden} is not the target's hidden size {target.hidden_size}")
    ids = hf_layer_ids(fmt, cfg)
    if kind == "eagle3":
        bad = [i for i in ids if not 0 < i < target.num_layers]
        if bad or len(set(ids)) != len(ids):
            fail("eagle_aux_hidden_state_layer_ids", f"{ids}: vLLM collects the state entering layer i, so each must "
                 f"be a distinct id in 1..{target.num_layers - 1} for this {target.num_layers}-layer target")
        if cfg.get("norm_before_fc") or cfg.get("fc_norm"):
            fail("norm_before_fc", "is set, but the fc weight is exported for the raw aux states (its aux scale "
                                   "folded in): write norm_before_fc and fc_norm false")
    if kind in ("dflash", "dspark"):
        bad = [i - 1 for i in ids if not 0 < i <= target.num_layers]
        if bad:
            fail("dflash_config.target_layer_ids", f"{[i - 1 for i in ids]}: vLLM reads the output of layer i, so "
                 f"each must be in 0..{target.num_layers - 1} (HF hidden-state id minus one)")
        block = cfg["block_size"]
        if k is not None and not 1 <= k <= block - 1:
            fail("block_size", f"{block} drafts {block - 1} tokens per block, but it is served with "
                               f"num_speculative_tokens {k}: serve with at most {block - 1}")
        mask = cfg["dflash_config"]["mask_token_id"]
        if not 0 <= mask < target.vocab_size:
            fail("dflash_config.mask_token_id", f"{mask} is outside the target's vocabulary of {target.vocab_size}")
        if kind == "dspark" and cfg.get("mask_token_id") != mask:
            fail("mask_token_id", f"{cfg.get('mask_token_id')} differs from dflash_config.mask_token_id {mask}: "
                                  "vLLM's DSpark reads both, and they must name the same token")
    if head_config is not None:
        trained = list(getattr(head_config, "aux_layer_ids", None) or getattr(head_config, "target_layer_ids", ()))
        if trained and ids != trained:
            field = "eagle_aux_hidden_state_layer_ids" if kind == "eagle3" else "dflash_config.target_layer_ids"
            fail(field, f"name HF hidden-state ids {ids}, but the head was trained on {trained}: the format's "
                        "layer-id convention was not applied")
    _check_vocab_maps(path, cfg, target, fail)


def _check_vocab_maps(path: Path, cfg: dict, target: TargetShape, fail) -> None:
    """d2t (draft id -> target id offsets) and t2d (target ids the draft vocabulary holds) agree."""
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        d2t = f.get_tensor("d2t") if "d2t" in names else None
        t2d = f.get_tensor("t2d") if "t2d" in names else None
    if d2t is None:
        return
    draft = cfg.get("draft_vocab_size")
    if draft is not None and d2t.numel() != draft:
        fail("d2t", f"holds {d2t.numel()} entries, but draft_vocab_size is {draft}")
    ids = torch.arange(d2t.numel()) + d2t.long()
    if ids.min() < 0 or ids.max() >= target.vocab_size:
        fail("d2t", f"maps draft ids outside the target's vocabulary of {target.vocab_size}")
    if len(set(ids.tolist())) != ids.numel():
        fail("d2t", "maps two draft ids to one target id")
    if t2d is not None:
        if t2d.numel() != target.vocab_size:
            fail("t2d", f"has {t2d.numel()} entries, not the target's vocabulary of {target.vocab_size}")
        if int(t2d.sum()) != d2t.numel() or not bool(t2d.bool()[ids].all()):
            fail("t2d", "does not mark exactly the target ids d2t maps to")
