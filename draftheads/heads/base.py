"""Head directories: ``config.json`` (with ``head_type``) + ``model.safetensors``."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftheads.errors import DraftheadsError
from draftheads.utils import atomic_dir, load_safetensors, safetensors_shapes

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def config_to_dict(config) -> dict:
    return dataclasses.asdict(config)


HEAD_FILES = (CONFIG_NAME, WEIGHTS_NAME)


def save_head_dir(out: str | os.PathLike, head_type: str, config, state_dict: dict, extra: dict | None = None,
                  overwrite: bool = False, inputs=()) -> Path:
    """Atomically write a head directory (replacing only a previous head there, unless ``overwrite``)."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    with atomic_dir(out, "head", overwrite=overwrite, inputs=inputs) as tmp:
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


def read_head_dir(path: str | os.PathLike) -> tuple[dict, Path]:
    """(config.json contents, path of the weights) of a head directory, or one clear error."""
    path = resolve_head(path)
    cfg_file, weights = path / CONFIG_NAME, path / WEIGHTS_NAME
    if not cfg_file.is_file() or not weights.is_file():
        raise DraftheadsError(
            f"head directory {str(path)!r} lacks {CONFIG_NAME} or {WEIGHTS_NAME}: point --head at a "
            "directory written by `train-head` or `draftheads import`, or name a shipped head: "
            f"{', '.join(sorted(SHIPPED_HEADS))}"
        )
    try:
        meta = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DraftheadsError(f"{cfg_file} is not valid JSON ({e}): the head directory is damaged; re-export or "
                              "retrain it") from None
    if not isinstance(meta, dict) or "head_type" not in meta or not isinstance(meta.get("config"), dict):
        raise DraftheadsError(
            f"{cfg_file} has no 'head_type' and 'config': this is not a draftheads head directory "
            "(convert public checkpoints with `draftheads import`)"
        )
    return meta, weights


def check_weight_shapes(module: torch.nn.Module, file: str | os.PathLike) -> None:
    """Every tensor name and shape of ``file`` against ``module`` (build it on the meta device: a config
    that asks for a huge module then allocates nothing)."""
    shapes = safetensors_shapes(file)
    want = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    missing, unexpected = sorted(want.keys() - shapes.keys()), sorted(shapes.keys() - want.keys())
    if missing or unexpected:
        raise DraftheadsError(f"{file}: weights do not match config.json (missing {missing[:4]}, unexpected "
                              f"{unexpected[:4]}): the directory is damaged or from another version; re-export it")
    wrong = [k for k in want if want[k] != shapes[k]]
    if wrong:
        k = wrong[0]
        raise DraftheadsError(f"{file}: {k} has shape {list(shapes[k])} but config.json makes it {list(want[k])} "
                              f"({len(wrong)} tensor(s) disagree): config and weights are from different heads")


def load_weights_checked(module: torch.nn.Module, file: str | os.PathLike) -> None:
    """Load ``file`` (already shape-checked) into ``module``, refusing NaN or inf values."""
    weights = load_safetensors(file)
    bad = next((k for k, v in weights.items() if v.is_floating_point() and not torch.isfinite(v).all()), None)
    if bad is not None:
        raise DraftheadsError(f"{file}: {bad} holds NaN or inf values: the head is damaged or diverged in training")
    module.load_state_dict(weights)


def build_config(cls, values, where: str, prefix: str = ""):
    """Build dataclass ``cls`` from JSON ``values``, checking fields, nested fields and types first, so a
    damaged or hand-edited config is one error naming the file and the field."""
    import typing

    if not isinstance(values, dict):
        raise DraftheadsError(f"{where}: {prefix.rstrip('.') or 'config'} must be a JSON object, not {values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise DraftheadsError(f"{where}: unknown field(s) {[prefix + u for u in unknown]} for {cls.__name__}: "
                              f"allowed {sorted(fields)}")
    missing = [n for n, f in fields.items() if n not in values and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise DraftheadsError(f"{where}: field(s) {[prefix + m for m in missing]} missing for {cls.__name__}")
    hints = typing.get_type_hints(cls)
    kw = {name: _typed(hints[name], v, where, prefix + name) for name, v in values.items()}
    try:
        return cls(**kw)
    except DraftheadsError as e:
        raise DraftheadsError(f"{where}: {e}") from None


def _typed(tp, v, where: str, name: str):
    import types
    import typing

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build_config(tp, v, where, name + ".")
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    ok = {int: isinstance(v, int) and not isinstance(v, bool),
          float: isinstance(v, (int, float)) and not isinstance(v, bool),
          bool: isinstance(v, bool), str: isinstance(v, str), dict: isinstance(v, dict)}
    if origin in (tuple, list):
        if isinstance(v, (list, tuple)):
            return tuple(_typed(args[0], x, where, f"{name}[{i}]") for i, x in enumerate(v))
    elif tp in ok:
        if ok[tp]:
            return float(v) if tp is float else v
    else:
        return v
    want = getattr(tp, "__name__", str(tp))
    raise DraftheadsError(f"{where}: {name} = {v!r} must be {'a list' if origin in (tuple, list) else want}")
