"""EAGLE-1 proposer: the draft reads the target's last hidden state (post-norm) and extrapolates
features autoregressively; logits come from the target's lm_head (or the head's draft vocabulary)."""

from __future__ import annotations

import torch

from draftheads.inference.projection import vocab_logits
from draftheads.inference.proposers.draft_tree import DraftTreeProposer


class EagleProposer(DraftTreeProposer):
    name = "eagle"

    def __init__(self, head, target):
        super().__init__(head, target.get_input_embeddings())
        self.layer_ids = (target.config.get_text_config().num_hidden_layers,)
        self.weight = head.projection(target.get_output_embeddings().weight)

    def entry_features(self, hidden):
        return hidden[self.layer_ids[0]].to(self.weight.dtype)

    def step(self, feats, tokens, positions, mask, cache):
        return self.head(self.embed(tokens).to(feats.dtype), feats, positions, mask=mask, cache=cache)

    def log_probs(self, out):
        return torch.log_softmax(vocab_logits(self.head.normed(out), self.weight).float(), -1)

    def to_target_ids(self, ids):
        return self.head.to_target_ids(ids)
