"""Draft heads: plain nn.Modules with typed configs, saved as head directories."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from draftheads.errors import DraftheadsError
from draftheads.heads.base import (
    build_config,
    check_weight_shapes,
    load_weights_checked,
    read_head_dir,
    save_head_dir,
)
from draftheads.heads.dflash import DFlashConfig, DFlashHead, default_target_layer_ids
from draftheads.heads.dspark import DSparkConfig, DSparkHead
from draftheads.heads.eagle import EagleConfig, EagleHead
from draftheads.heads.eagle3 import Eagle3Config, Eagle3Head, default_aux_layer_ids
from draftheads.heads.layers import LayerSpec
from draftheads.heads.medusa import MedusaConfig, MedusaHeads


@dataclass(frozen=True)
class HeadFamily:
    """One head family's record: its config and module and the target layers its training reads. The other
    layers register against the family's name: its proposer (``draftheads.inference.proposers.register``),
    its export formats (``draftheads.export.vllm.register_format``); its LightningModule is named by the
    ``train-head`` config that trains it. A new family is :func:`register_family` plus those, in its own files."""

    config: type
    module: type
    feature_layers: Callable[[int], list[int]]
    """HF hidden-state ids its training reads from a target of ``num_layers`` layers (default config)."""


def _last_layer(num_layers: int) -> list[int]:
    return [num_layers]


def _eagle3_layers(num_layers: int) -> list[int]:
    return sorted(set(default_aux_layer_ids(num_layers)) | {num_layers})


def _dflash_layers(num_layers: int) -> list[int]:
    return list(default_target_layer_ids(num_layers))


FAMILIES = {
    "medusa": HeadFamily(MedusaConfig, MedusaHeads, _last_layer),
    "eagle": HeadFamily(EagleConfig, EagleHead, _last_layer),
    "eagle3": HeadFamily(Eagle3Config, Eagle3Head, _eagle3_layers),
    "dflash": HeadFamily(DFlashConfig, DFlashHead, _dflash_layers),
    "dspark": HeadFamily(DSparkConfig, DSparkHead, _dflash_layers),
}
"""Head type -> its family's record (the ``head_type`` a head directory's config.json names)."""


def register_family(name: str, record: HeadFamily) -> HeadFamily:
    """Add a head family (``record.module.head_type`` must be ``name``, as the heads it saves will say)."""
    if getattr(record.module, "head_type", None) != name:
        raise DraftheadsError(f"family {name!r}: its module's head_type is {getattr(record.module, 'head_type', None)!r}")
    FAMILIES[name] = record
    return record


def family(head_type: str) -> HeadFamily:
    if head_type not in FAMILIES:
        raise DraftheadsError(f"head_type {head_type!r} is unknown: expected one of {sorted(FAMILIES)}")
    return FAMILIES[head_type]

__all__ = [
    "FAMILIES", "HeadFamily", "register_family", "DFlashConfig", "DFlashHead", "DSparkConfig", "DSparkHead", "family", "EagleConfig", "EagleHead", "Eagle3Config", "Eagle3Head", "LayerSpec", "MedusaConfig",
    "MedusaHeads", "default_aux_layer_ids", "load_head", "save_head", "check_head_fits_target",
]


def save_head(head, out: str | os.PathLike, extra: dict | None = None, overwrite: bool = False, inputs=()):
    return save_head_dir(out, head.head_type, head.config, head.state_dict(), extra, overwrite, inputs)


def load_head(path: str | os.PathLike):
    """Load a head directory -> (module in eval mode, metadata dict). Config fields and types, tensor names
    and shapes are checked before any weight is allocated."""
    import torch

    meta, weights = read_head_dir(path)
    kind = meta["head_type"]
    if kind not in FAMILIES:
        raise DraftheadsError(f"{path}: head_type {kind!r} is unknown: expected one of {sorted(FAMILIES)}")
    fam = FAMILIES[kind]
    config = build_config(fam.config, meta["config"], f"{path}/config.json")
    with torch.device("meta"):
        shaped = fam.module(config)
    check_weight_shapes(shaped, weights)
    head = fam.module(config)
    load_weights_checked(head, weights)
    return head.eval(), meta


def check_head_fits_target(head, info) -> None:
    """One clear error when a head was built for another target."""
    c = head.config
    if c.hidden_size != info.hidden_size and getattr(c, "target_hidden_size", c.hidden_size) != info.hidden_size:
        raise DraftheadsError(
            f"{head.head_type} head has hidden size {c.hidden_size} but target {info.name} has "
            f"{info.hidden_size}: use a head trained for this target"
        )
    if getattr(c, "target_hidden_size", None) not in (None, info.hidden_size):
        raise DraftheadsError(
            f"eagle3 head expects target hidden size {c.target_hidden_size} but target {info.name} has "
            f"{info.hidden_size}: use a head trained for this target"
        )
    if c.vocab_size != info.vocab_size:
        raise DraftheadsError(
            f"{head.head_type} head has vocab size {c.vocab_size} but target {info.name} has "
            f"{info.vocab_size}: use a head trained for this target's tokenizer"
        )
    ids = getattr(c, "aux_layer_ids", None) or getattr(c, "target_layer_ids", ())
    if ids and (max(ids) > info.num_layers or min(ids) < 0):
        raise DraftheadsError(
            f"{head.head_type} target layer ids {list(ids)} fall outside 0..{info.num_layers} of target "
            f"{info.name}: retrain with ids valid for this target"
        )
