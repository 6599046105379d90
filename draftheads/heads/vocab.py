"""Draft vocabularies: the most frequent target tokens, with EAGLE-3's ``d2t`` / ``t2d`` maps.

* ``draft_ids`` [draft_vocab] int64: target id of each draft index, in ascending target-id order;
* ``d2t`` [draft_vocab] int64 offsets: ``target_id = i + d2t[i]`` (vLLM's convention; absolute ids
  crash vLLM);
* ``t2d`` [target_vocab] bool: which target ids are in the draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftheads.errors import DraftheadsError


@dataclass
class DraftVocab:
    draft_ids: torch.Tensor  # [draft_vocab] int64, ascending target ids
    target_vocab_size: int
    coverage: float  # fraction of counted target tokens that the draft vocab covers
    held_out_coverage: float | None = None  # the same on held-out text, when it was counted

    @property
    def size(self) -> int:
        return int(self.draft_ids.numel())

    @property
    def d2t(self) -> torch.Tensor:
        return self.draft_ids - torch.arange(self.size, dtype=torch.int64)

    @property
    def t2d(self) -> torch.Tensor:
        mask = torch.zeros(self.target_vocab_size, dtype=torch.bool)
        mask[self.draft_ids] = True
        return mask

    @classmethod
    def from_d2t(cls, d2t: torch.Tensor, target_vocab_size: int, coverage: float = float("nan")) -> DraftVocab:
        ids = d2t.to(torch.int64) + torch.arange(d2t.numel(), dtype=torch.int64)
        return cls(ids, target_vocab_size, coverage)

    @classmethod
    def full(cls, vocab_size: int) -> DraftVocab:
        return cls(torch.arange(vocab_size, dtype=torch.int64), vocab_size, 1.0)


def token_counts(token_batches, vocab_size: int) -> torch.Tensor:
    """Count target tokens over an iterable of id tensors (e.g. the loss-masked training targets)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids in token_batches:
        ids = torch.as_tensor(ids).reshape(-1)
        counts += torch.bincount(ids[(ids >= 0) & (ids < vocab_size)], minlength=vocab_size)
    return counts


def build_draft_vocab(counts: torch.Tensor, size: int | None = None, coverage: float = 0.98,
                      held_out: torch.Tensor | None = None, tie_break: torch.Tensor | None = None,
                      max_size: int | None = None) -> DraftVocab:
    """The most frequent tokens of ``counts`` (ties broken by ``tie_break`` counts, e.g. every token of
    the training text): ``size`` of them, or the fewest covering ``coverage`` of the ``held_out`` counts
    (of ``counts`` themselves when none are given), at most ``max_size``."""
    counts = counts.to(torch.int64)
    total = int(counts.sum())
    if total == 0:
        raise DraftheadsError("draft vocabulary: no target tokens were counted: check that the training data has assistant tokens")
    if size is not None and not 1 <= size <= counts.numel():
        raise DraftheadsError(f"draft_vocab_size {size} must be in 1..{counts.numel()}")
    if not 0 < coverage <= 1:
        raise DraftheadsError(f"draft vocab coverage {coverage} must be in (0, 1]")
    order = torch.arange(counts.numel())
    if tie_break is not None:
        order = torch.argsort(tie_break.to(torch.int64), descending=True, stable=True)
    order = order[torch.argsort(counts[order], descending=True, stable=True)]
    if held_out is not None and int(held_out.sum()) == 0:
        held_out = None
    if size is None:
        ref = (held_out if held_out is not None else counts).to(torch.int64)
        cum = torch.cumsum(ref[order], 0)
        size = int(torch.searchsorted(cum, torch.tensor(coverage * int(ref.sum()), dtype=cum.dtype)).item()) + 1
        size = min(size, counts.numel(), max_size or counts.numel())
    chosen = torch.sort(order[:size]).values
    cov = float(counts[chosen].sum()) / total
    held = float(held_out[chosen].sum()) / int(held_out.sum()) if held_out is not None else None
    return DraftVocab(chosen, counts.numel(), cov, held)
