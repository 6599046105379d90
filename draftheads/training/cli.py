"""``train-head``: LightningCLI over the head modules and the chat data module.

    train-head fit --config configs/smollm2-eagle3-demo.yaml [--trainer.devices 8 --trainer.num_nodes 2
                   --trainer.strategy ddp|fsdp] [--ckpt_path last]
"""

from __future__ import annotations

import logging
import os
import sys

from draftheads.errors import DraftheadsError


def main(argv=None) -> int:
    os.environ.setdefault("WANDB_MODE", "offline")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from lightning.pytorch.cli import LightningCLI

    from draftheads.training.datamodule import ChatDataModule
    from draftheads.training.module import DraftHeadModule

    class TrainHeadCLI(LightningCLI):
        def add_arguments_to_parser(self, parser):
            parser.link_arguments("model.init_args.target", "data.target", apply_on="parse")

    try:
        TrainHeadCLI(
            DraftHeadModule, ChatDataModule, subclass_mode_model=True, args=argv,
            save_config_kwargs={"overwrite": True}, auto_configure_optimizers=False,
        )
    except DraftheadsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
