"""The serving contract of an export, checked against its target without vLLM.

vLLM loads a draft whose fields disagree with its target or with how it was trained, and then accepts
almost nothing, with no error. These are the fields where that has happened in the field: the layer ids
(each format counts them its own way), the block size against the number of speculative tokens, the mask
token, the draft vocabulary maps, the fc input's normalisation, and the vocabulary and hidden sizes.
:func:`check_contract` stops at the first wrong one with one line naming it.

Each format counts layers its own way; its record says how (``layer_ids``, ``layer_convention``): EAGLE-3's
``eagle_aux_hidden_state_layer_ids`` are the states vLLM collects entering layer i (HF hidden-state id i, for
0 < i < num_layers), DFlash's ``dflash_config.target_layer_ids`` the outputs of layer i (HF id i + 1).
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


def check_contract(path: str | os.PathLike, spec, target: TargetShape, k: int | None = None,
                   head_config=None) -> None:
    """The export at ``path`` in the format ``spec`` (its :class:`~draftheads.export.vllm.ExportFormat`,
    whose record says what differs between formats) against ``target``, served with ``k`` speculative
    tokens (when known) and made from a head of ``head_config`` (when known: its layer ids must survive the
    format's convention). Raises :class:`DraftheadsError` naming the first field that breaks the contract."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    fmt = spec.name

    def fail(field: str, problem: str):
        raise DraftheadsError(f"export {path} ({fmt}): {field} {problem}")

    layer = cfg.get("transformer_layer_config", cfg)  # speculators nests the draft layer's config
    if layer.get("vocab_size") is not None and layer["vocab_size"] != target.vocab_size:
        fail("vocab_size", f"{layer['vocab_size']} is not the target's {target.vocab_size}: train the head on this "
                           "target's tokenizer")
    field = "target_hidden_size" if "target_hidden_size" in cfg else "hidden_size"
    if field == "hidden_size" and spec.layer_ids is not None:
        field = ""  # a block drafter's own width, free of the target's
    if field and cfg.get(field) is not None and cfg[field] != target.hidden_size:
        fail(field, f"{cfg[field]} is not the target's hidden size {target.hidden_size}")
    if spec.layer_ids is not None:
        ids = spec.layer_ids(cfg)
        valid = spec.layer_range(target.num_layers)
        if any(i not in valid for i in ids) or len(set(ids)) != len(ids):
            fail(spec.layer_field, f"names HF hidden-state ids {ids}; {spec.layer_convention}, so each must be a "
                                   f"distinct one in {valid.start}..{valid.stop - 1} for this {target.num_layers}-layer "
                                   "target")
        trained = list(getattr(head_config, "aux_layer_ids", None) or getattr(head_config, "target_layer_ids", ()))
        if trained and ids != trained:
            fail(spec.layer_field, f"names HF hidden-state ids {ids}, but the head was trained on {trained}: the "
                                   f"format's convention ({spec.layer_convention}) was not applied")
    if spec.contract is not None:
        spec.contract(cfg, k, target, fail)
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
