import lightning as L


class StopAfterEpoch(L.Callback):
    """Ends fit after ``epoch`` (0-based) as an interruption would, once that epoch's checkpoint exists."""

    def __init__(self, epoch: int):
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            trainer.should_stop = True


class StopAfterStep(L.Callback):
    """Ends fit after optimizer step ``step`` (1-based) as an interruption would, part-way through an epoch."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.should_stop = True
