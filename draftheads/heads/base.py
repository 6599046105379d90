"""Head directories: ``config.json`` (with ``head_type``) + ``model.safetensors``."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftheads.errors import DraftheadsError
from draftheads.utils import atomic_dir

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def config_to_dict(config) -> dict:
    return dataclasses.asdict(config)


def save_head_dir(out: str | os.PathLike, head_type: str, config, state_dict: dict, extra: dict | None = None) -> Path:
    """Atomically write a head directory."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    with atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"head_type": head_type})
        meta = {"head_type": head_type, "config": config_to_dict(config), **(extra or {})}
        (tmp / CONFIG_NAME).write_text(json.dumps(meta, indent=2) + "\n")
    return Path(out)


# Heads shipped inside the package (draftheads/data/heads/<name>/), each with a CARD.md; ``reference``
# names the one for the embedded default target.
SHIPPED_HEADS = {"smollm2-135m-eagle3": "smollm2-135m-eagle3", "reference": "smollm2-135m-eagle3"}


def shipped_head_path(name: str) -> Path:
    from importlib import resources

    return Path(str(resources.files("draftheads") / "data" / "heads" / SHIPPED_HEADS[name]))


def resolve_head(spec: str | os.PathLike) -> Path:
    """A head directory, or the name of a shipped head (``reference``, ``smollm2-135m-eagle3``)."""
    if str(spec) in SHIPPED_HEADS and not Path(spec).is_dir():
        path = shipped_head_path(str(spec))
        if not (path / WEIGHTS_NAME).is_file():
            raise DraftheadsError(
                f"shipped head {str(spec)!r} is not in this installation: build it with `make reference-head`, "
                "or give --head a head directory"
            )
        return path
    return Path(spec)


def read_head_dir(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    path = resolve_head(path)
    cfg_file, weights = path / CONFIG_NAME, path / WEIGHTS_NAME
    if not cfg_file.is_file() or not weights.is_file():
        raise DraftheadsError(
            f"head directory {str(path)!r} lacks {CONFIG_NAME} or {WEIGHTS_NAME}: point --head at a "
            "directory written by `train-head` or `draftheads import`, or name a shipped head: "
            f"{', '.join(sorted(SHIPPED_HEADS))}"
        )
    meta = json.loads(cfg_file.read_text())
    if "head_type" not in meta:
        raise DraftheadsError(
            f"{cfg_file} has no 'head_type': this is not a draftheads head directory "
            "(convert public checkpoints with `draftheads import`)"
        )
    return meta, load_file(str(weights))


def build_config(cls, values: dict, where: str):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - names
    if unknown:
        raise DraftheadsError(f"{where}: unknown field(s) {sorted(unknown)} for {cls.__name__}: allowed {sorted(names)}")
    return cls(**values)
