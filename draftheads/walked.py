"""Walked τ at validation: a Lightning callback that replays the engine's drafting with the head being
trained along validation answers (:mod:`draftheads.inference.replay`) and logs its τ per mode as
``val/walk_tau_<mode>``, the number ``draftheads walk`` gives on the eval's prompts.

It sits beside training and inference, not in either (they import neither each other): a config names it
under ``trainer.callbacks``::

    - class_path: draftheads.walked.WalkedTau
      init_args: {modes: [chain3], answers: 32, window: 128}

It reads what any draft-head module has (``head``, ``target``, ``features``) and leaves the last τ per
mode on the module as ``last_val_walk``, which the head's ``config.json`` keeps (``val_walk_tau``).
"""

from __future__ import annotations

import logging

import lightning as L
from lightning.pytorch.strategies import FSDPStrategy

from draftheads.errors import DraftheadsError
from draftheads.inference.proposers import proposer_for
from draftheads.inference.replay import row_texts, summary, walk
from draftheads.inference.tree import parse_tree

log = logging.getLogger(__name__)


class WalkedTau(L.Callback):
    """``modes``: chainK or tree names to walk; ``answers``: validation answers walked (the first met);
    ``window``: tokens walked of each answer (the eval's ``--max-new-tokens``)."""

    def __init__(self, modes: tuple[str, ...] = ("chain3",), answers: int = 32, window: int = 128):
        if not modes or "auto" in modes:
            raise DraftheadsError("WalkedTau modes: give chainK or tree names, e.g. [chain3] (auto cannot be "
                                  "walked: what it drafts depends on step times)")
        if answers < 1 or window < 1:
            raise DraftheadsError(f"WalkedTau answers={answers} and window={window} must be >= 1")
        self.specs = {m: parse_tree(m) for m in modes}
        self.answers, self.window = answers, window
        self._reset()

    def _reset(self) -> None:
        self.proposer, self.modes, self.texts, self.hidden = None, [], [], []

    def on_validation_epoch_start(self, trainer, pl_module):
        self._reset()
        if pl_module.target is None or isinstance(trainer.strategy, FSDPStrategy):
            return  # under FSDP the head's weights are sharded outside its forward
        proposer = proposer_for(pl_module.head.head_type)(pl_module.head, pl_module.target)
        for mode, spec in self.specs.items():
            try:
                proposer.check_tree(spec)
                self.modes.append(mode)
            except DraftheadsError as e:
                log.warning("WalkedTau: %s is not walked: %s", mode, e)
        self.proposer = proposer if self.modes else None

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        most = self.answers - len(self.texts)
        if self.proposer is None or most <= 0:
            return
        texts, hidden = row_texts(batch, pl_module.features(batch, list(self.proposer.layer_ids)), self.window, most)
        self.texts += texts
        self.hidden += hidden

    def on_validation_epoch_end(self, trainer, pl_module):
        if self.texts:
            pl_module.last_val_walk = {}
            for mode in self.modes:
                tau = summary(self.texts, walk(self.proposer, self.texts, self.hidden, self.specs[mode]))["overall"]["tau"]
                pl_module.last_val_walk[mode] = tau
                pl_module.log(f"val/walk_tau_{mode}", tau, prog_bar=True, sync_dist=True)
        self._reset()
