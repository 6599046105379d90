"""``train-head``: LightningCLI over the head modules and the chat data module.

    train-head fit --config configs/smollm2-eagle3-demo.yaml [--trainer.devices 8 --trainer.num_nodes 2
                   --trainer.strategy ddp|fsdp] [--ckpt_path last]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from draftheads.errors import DraftheadsError


def main(argv=None) -> int:
    os.environ.setdefault("WANDB_MODE", "offline")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("lightning.fabric.utilities.seed").setLevel(logging.WARNING)  # "Seed set to 0"
    # ChatDataModule saves its place in the epoch in every checkpoint and resumes there
    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")
    from lightning.pytorch.cli import LightningCLI

    from draftheads.training.datamodule import ChatDataModule
    from draftheads.training.module import DraftHeadModule

    class TrainHeadCLI(LightningCLI):
        def init_parser(self, **kwargs):
            return super().init_parser(exit_on_error=False, **kwargs)  # errors reach main as one line

        def add_arguments_to_parser(self, parser):
            parser.link_arguments("model.init_args.target", "data.target", apply_on="parse")

        def parse_arguments(self, parser, args):
            super().parse_arguments(parser, args)
            sub = self.config.get("subcommand")  # checked before LightningCLI reads the checkpoint's hparams
            check_ckpt_path(self.config[sub].get("ckpt_path") if sub else None)

    try:
        TrainHeadCLI(
            DraftHeadModule, ChatDataModule, subclass_mode_model=True, args=argv,
            save_config_kwargs={"overwrite": True}, auto_configure_optimizers=False,
        )
    except DraftheadsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except argparse.ArgumentError as e:
        print(f"error: {one_line(e)} (see `train-head fit --help`)", file=sys.stderr)
        return 2
    except Exception as e:  # a module's own check, wrapped by jsonargparse while it builds the classes
        ours = _cause(e, DraftheadsError)
        if ours is None:
            raise
        print(f"error: {ours}", file=sys.stderr)
        return 2
    return 0


def _cause(e: BaseException | None, kind: type):
    while e is not None and not isinstance(e, kind):
        e = e.__cause__ or e.__context__
    return e


def one_line(e: BaseException) -> str:
    """A parse error as one line: our own check's message when one caused it, else the parser's first line."""
    ours = _cause(e, DraftheadsError)
    if ours is not None:
        return str(ours)
    lines = [ln.strip(" -") for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return "invalid arguments"
    problem = next((i for i, ln in enumerate(lines) if ln.startswith("Problem with given class_path")), None)
    if problem is not None and problem + 1 < len(lines):  # a union of classes: the class that was meant
        cls = lines[problem].split("'")[1] if lines[problem].count("'") >= 2 else "class"
        return " ".join(f"{lines[0]} {cls}: {lines[problem + 1]}".split())
    first = lines[0] + (" " + lines[1] if lines[0].endswith(":") and len(lines) > 1 else "")
    return " ".join(first.split())


def check_ckpt_path(path) -> None:
    """``--ckpt_path`` must be ``last``/``best``/``hpc`` or a whole checkpoint file (a torch zip archive)."""
    import zipfile

    if path is None or str(path) in ("last", "best", "hpc", "registry"):
        return
    if not os.path.isfile(path):
        raise DraftheadsError(f"--ckpt_path {path} does not exist: give a checkpoint file, or last to resume the run")
    if not zipfile.is_zipfile(path):
        raise DraftheadsError(f"--ckpt_path {path} is not a whole checkpoint (truncated or another kind of file): "
                              "give the run's last.ckpt, or last")



def config_under(base, out, feature_dir, trainer: dict | None = None, model: dict | None = None,
                 data: dict | None = None) -> dict:
    """The ``train-head`` config ``base`` (a YAML path) with everything it writes under ``out`` (the
    trainer's root and loggers at ``out/train``, checkpoints at ``out/train/checkpoints``, the head at
    ``out/head``), reading ``feature_dir``; ``trainer``, ``model`` (its ``init_args``) and ``data``
    override keys of those sections."""
    from pathlib import Path

    import yaml

    out = Path(out)
    cfg = yaml.safe_load(Path(base).read_text())
    tr = cfg["trainer"]
    tr["default_root_dir"] = str(out / "train")
    for logger in tr.get("logger") or []:
        logger["init_args"]["save_dir"] = str(out / "train")
    for cb in tr.get("callbacks") or []:
        if cb["class_path"].endswith("ModelCheckpoint"):
            cb["init_args"]["dirpath"] = str(out / "train/checkpoints")
    tr.update(trainer or {})
    cfg["model"]["init_args"].update({"head_dir": str(out / "head"), **(model or {})})
    cfg["data"].update({"feature_dir": str(feature_dir), **(data or {})})
    return cfg


def save_config(cfg: dict, path, source: str):
    """Write ``cfg`` as YAML to ``path`` with a first line naming ``source``; returns the path."""
    from pathlib import Path

    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# written from {source}\n" + yaml.safe_dump(cfg, sort_keys=False))
    return path


if __name__ == "__main__":
    sys.exit(main())
