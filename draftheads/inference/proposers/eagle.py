"""EAGLE-1 proposer: the draft reads the target's last hidden state (post-norm) and extrapolates
features autoregressively; logits come from the target's lm_head (or the head's draft vocabulary)."""

from __future__ import annotations

from draftheads.inference.proposers.draft_tree import DraftTreeProposer
from draftheads.inference.proposers.registry import register


@register("eagle")
class EagleProposer(DraftTreeProposer):
    name = "eagle"

    def __init__(self, head, target):
        super().__init__(head, target)
        self.layer_ids = (target.config.get_text_config().num_hidden_layers,)

    def entry_features(self, hidden):
        return hidden[self.layer_ids[0]].to(self.weight.dtype)
