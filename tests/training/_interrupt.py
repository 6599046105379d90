import lightning as L


class StopAfterEpoch(L.Callback):
    """Ends fit after ``epoch`` (0-based) as an interruption would, once that epoch's checkpoint exists."""

    def __init__(self, epoch: int):
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            trainer.should_stop = True
