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
