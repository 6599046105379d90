"""Medusa proposer: heads on the target's last hidden state at the last accepted token; the tree is a
static shape of rank paths filled with each head's top-k tokens (cartesian candidates). A named tree
becomes the shape of the same size that maximises expected acceptance under a decaying prior, cut to
the head's depth; a tree file gives the shape itself."""

from __future__ import annotations

import torch

from draftheads.inference.proposers.base import Proposer, RequestState
from draftheads.inference.proposers.registry import register
from draftheads.inference.tree import Tree, TreeSpec, static_tree


@register("medusa")
class MedusaProposer(Proposer):
    name = "medusa"


    def __init__(self, head, target):
        self.head = head.eval()
        self.layer_ids = (target.config.get_text_config().num_hidden_layers,)
        self.target_lm_head = target.get_output_embeddings().weight
        self.num_heads = head.config.num_heads
        self.last: dict[int, torch.Tensor] = {}
        self.auto_pool = TreeSpec(depth=self.num_heads, top_k=4, total_tokens=32, name="auto")

    def check_tree(self, tree: TreeSpec) -> None:
        tree.shape(self.num_heads)  # a tree file deeper than the head is refused

    def start(self, st: RequestState, hidden) -> None:
        self.last[st.rid] = hidden[self.layer_ids[0]][-1]

    def observe(self, st: RequestState, hidden, num_new: int) -> None:
        self.last[st.rid] = hidden[self.layer_ids[0]][num_new - 1]

    def finish(self, st: RequestState) -> None:
        self.last.pop(st.rid, None)

    @torch.no_grad()
    def propose(self, st: RequestState, tree: TreeSpec) -> Tree:
        parents, paths = static_tree(tree, self.num_heads)
        top_k = max(max(p) for p in paths[1:]) + 1
        h = self.last[st.rid].to(self.target_lm_head.dtype)
        feats = self.head(h[None])[:, 0]  # [K, H]
        top, logp = [], []
        for d in range(max(len(p) for p in paths)):
            logits = feats[d] @ self.head.projection(d, self.target_lm_head).T
            best = torch.topk(torch.log_softmax(logits.float(), -1), min(top_k, logits.numel()))
            top.append(self.head.to_target_ids(best.indices).tolist())
            logp.append(best.values.tolist())
        tokens = [st.root] + [top[len(p) - 1][p[-1]] for p in paths[1:]]
        scores = [0.0] + [sum(logp[d][r] for d, r in enumerate(p)) for p in paths[1:]]
        return Tree(tokens, list(parents), scores=scores)
