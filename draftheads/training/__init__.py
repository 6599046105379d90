"""Training: LightningModules per head family, losses, data and the `train-head` CLI."""

from draftheads.training.datamodule import ChatDataModule
from draftheads.training.dflash import DFlashModule
from draftheads.training.dspark import DSparkModule
from draftheads.training.eagle import Eagle3Module, EagleModule
from draftheads.training.medusa import MedusaModule
from draftheads.training.module import DraftHeadModule

__all__ = ["ChatDataModule", "DFlashModule", "DSparkModule", "DraftHeadModule", "Eagle3Module", "EagleModule", "MedusaModule"]
