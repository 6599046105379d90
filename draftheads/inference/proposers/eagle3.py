"""EAGLE-3 proposer: features from three target layers fused by ``fc``; the draft's pre-norm output
is the next step's hidden input; logits over the draft vocabulary map back through ``d2t``."""

from __future__ import annotations

import torch

from draftheads.inference.proposers.draft_tree import DraftTreeProposer
from draftheads.inference.proposers.registry import register


@register("eagle3")
class Eagle3Proposer(DraftTreeProposer):
    name = "eagle3"

    def __init__(self, head, target):
        super().__init__(head, target)
        self.layer_ids = tuple(head.config.aux_layer_ids)

    def entry_features(self, hidden):
        dtype = self.head.fc.weight.dtype
        return self.head.fuse(torch.cat([hidden[i].to(dtype) for i in self.layer_ids], -1))
