"""Medusa proposer: heads on the target's last hidden state at the last accepted token; the tree is a
static shape of rank paths filled with each head's top-k tokens (cartesian candidates)."""

from __future__ import annotations

import torch

from draftheads.inference.proposers.base import Proposer, RequestState
from draftheads.inference.tree import Tree, default_rank_accept, greedy_shape, shape_from_paths


class MedusaProposer(Proposer):
    name = "medusa"

    def __init__(self, head, target, shape=None):
        self.head = head.eval()
        cfg = head.config
        self.layer_ids = (target.config.get_text_config().num_hidden_layers,)
        self.target_lm_head = target.get_output_embeddings().weight
        self.num_heads = cfg.num_heads
        self.set_shape(shape or greedy_shape(default_rank_accept(cfg.num_heads, 4), 15))
        self.last: dict[int, torch.Tensor] = {}

    def set_shape(self, shape) -> None:
        shape = [p for p in shape if len(p) <= self.num_heads]
        self.parents, self.paths = shape_from_paths(shape)
        self.top_k = max(max(p) for p in self.paths[1:]) + 1
        self.depth = max(len(p) for p in self.paths)

    def set_tree(self, name: str) -> None:
        from draftheads.inference.tree import load_shape

        self.set_shape(load_shape(name))

    def start(self, st: RequestState, hidden) -> None:
        self.last[st.rid] = hidden[self.layer_ids[0]][-1]

    def observe(self, st: RequestState, hidden, num_new: int) -> None:
        self.last[st.rid] = hidden[self.layer_ids[0]][num_new - 1]

    def finish(self, st: RequestState) -> None:
        self.last.pop(st.rid, None)

    @torch.no_grad()
    def propose(self, st: RequestState) -> Tree:
        h = self.last[st.rid].to(self.target_lm_head.dtype)
        feats = self.head(h[None])[:, 0]  # [K, H]
        top = []
        for d in range(self.depth):
            logits = feats[d] @ self.head.projection(d, self.target_lm_head).T
            idx = torch.topk(logits, min(self.top_k, logits.numel())).indices
            top.append(self.head.to_target_ids(idx).tolist())
        tokens = [st.root] + [top[len(p) - 1][p[-1]] for p in self.paths[1:]]
        return Tree(tokens, list(self.parents))
