"""A packed batch for block-drafter tests: two rows, the second holding two documents, the loss on the
answer part of each."""

import torch


def block_batch(t=24, vocab=300):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (2, t), generator=g)
    loss_mask = torch.zeros(2, t, dtype=torch.long)
    loss_mask[:, 6:] = 1
    doc_ids = torch.zeros(2, t, dtype=torch.long)
    doc_ids[1, 14:] = 1  # the second row packs two documents
    pos = torch.arange(t).repeat(2, 1)
    pos[1, 14:] = torch.arange(t - 14)
    return {"input_ids": ids, "loss_mask": loss_mask, "doc_ids": doc_ids, "position_ids": pos}


class BatchCounts:
    """The token counts a draft vocabulary is built from (a datamodule's ``token_counts``), of one batch."""

    def __init__(self, batch: dict):
        self.ids = batch["input_ids"]

    def token_counts(self, vocab_size: int, split: str = "train", masked: bool = True) -> torch.Tensor:
        return torch.bincount(self.ids.flatten(), minlength=vocab_size)


def with_draft_vocab(module, size: int, batch: dict):
    """``module`` building its head over the ``size`` most frequent tokens of ``batch`` (no datamodule)."""
    cls = type(module)
    module.build_head = lambda info, _dm: cls.build_head(module, info, BatchCounts(batch))
    module.hparams.draft_vocab_size = size
    return module
