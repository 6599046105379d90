"""DSpark proposer: the DFlash block forward and its backbone logits, then left-to-right decoding of
the block with the Markov bias of each drafted token added to the next position's logits, cut where
the confidence head's running survival probability falls below ``min_survival``.

Greedy and tree drafts expand each node with the bias of its own token (the tree's nodes at one depth
differ in their parents' tokens, so their children's distributions differ); sampled chains draw each
token from the biased distribution given the token drawn before it (DSpark's sequential sampling).
"""

from __future__ import annotations

import torch

from draftheads.inference.projection import vocab_logits
from draftheads.inference.proposers.dflash import DFlashProposer
from draftheads.inference.proposers.registry import register

DEFAULT_MIN_SURVIVAL = 0.1
"""Below this estimated probability of being accepted, a draft costs more verification than it is
expected to return on a CPU (one more verified token costs a few percent of a step)."""


@register("dspark")
class DSparkProposer(DFlashProposer):
    name = "dspark"

    def __init__(self, head, target, min_survival: float = DEFAULT_MIN_SURVIVAL):
        super().__init__(head, target, min_survival=min_survival if head.config.confidence_head else 0.0)
        head.use_target_mask(self.embed.weight)

    def bias(self, prev: torch.Tensor) -> torch.Tensor | None:
        """The Markov head's logits ``markov_w2(markov_w1[prev])`` [n, V'] (None at rank 0)."""
        e = self.head.markov_embed(prev)
        return None if e is None else vocab_logits(e, self.head.markov_head.markov_w2.weight.to(e.dtype)).float()

    def survival(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        if not self.head.config.confidence_head:
            return None
        return torch.sigmoid(self.head.confidence_logit(hidden, prev))
