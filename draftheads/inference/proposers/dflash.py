"""DFlash proposer: one draft forward per step gives a whole block of per-position distributions.

The context keys and values of committed tokens are kept per request and layer (computed from the
target's hidden states when a draft is next asked for, one forward for all that arrived, so plain
steps cost nothing). A step runs the block ``[root, MASK x (block_size - 1)]`` at positions
P .. P + block_size - 1 (P = the root's position) against them, and reads log-probabilities for the
positions P + 1 .. P + block_size - 1.

* Chain (``top_k == 1``): the best token at each position, up to the tree's depth.
* Tree over the block: the block's positions are drafted independently of each other, so a candidate
  at depth d is any of position d's top-k tokens after any kept node at depth d - 1, scored by the sum
  of log-probabilities along its path. At each depth the ``top_k`` best frontier nodes are expanded,
  then the best ``total_tokens - 1`` nodes are kept (the EAGLE-2 selection, on one forward's output).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftheads.errors import DraftheadsError
from draftheads.inference.proposers.base import FollowingProposer, RequestState
from draftheads.inference.proposers.draft_tree import Node, select_tree
from draftheads.inference.tree import Tree, TreeSpec


@dataclass
class BlockState:
    kv: list | None = None  # per draft layer (k, v) [1, kv_heads, n, D] of the committed context
    pending: list = field(default_factory=list)  # target hidden states of committed tokens not yet injected

    @property
    def length(self) -> int:
        return 0 if self.kv is None else self.kv[0][0].shape[2]


class DFlashProposer(FollowingProposer):
    name = "dflash"
    auto_trees = ("chain3", "chain7", "small", "medium")
    state_type = BlockState

    def __init__(self, head, target):
        super().__init__()
        self.head = head.eval()
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings().weight
        self.layer_ids = tuple(head.config.target_layer_ids)

    def check_tree(self, tree: TreeSpec) -> None:
        super().check_tree(tree)
        if tree.depth > self.head.config.drafts_per_block:
            raise DraftheadsError(f"tree {tree.label} is {tree.depth} deep but this dflash head drafts "
                                  f"{self.head.config.drafts_per_block} positions per block: use a depth <= "
                                  f"{self.head.config.drafts_per_block}")

    # -- following the committed sequence (FollowingProposer keeps the hidden states) ---------------

    @torch.no_grad()
    def _catch_up(self, st: RequestState) -> BlockState:
        bs = self.states[st.rid]
        hidden = self.take_pending(st)
        if hidden is None:
            return bs
        dtype = self.head.fc.weight.dtype
        feats = torch.cat([hidden[i].to(dtype) for i in self.layer_ids], -1)[None]
        first = bs.length
        assert first + feats.shape[1] == st.kv_len, (first, feats.shape[1], st.kv_len)
        pos = torch.arange(first, st.kv_len, device=feats.device)[None]
        kv = self.head.context_kv(self.head.context(feats), pos)
        bs.kv = kv if bs.kv is None else [(torch.cat([k0, k], 2), torch.cat([v0, v], 2))
                                          for (k0, v0), (k, v) in zip(bs.kv, kv)]
        return bs

    # -- drafting ------------------------------------------------------------

    @torch.no_grad()
    def block_log_probs(self, st: RequestState) -> torch.Tensor:
        """[block_size - 1, V'] log-probabilities of positions P + 1 .. (head vocabulary)."""
        bs = self._catch_up(st)
        cfg = self.head.config
        dtype = self.head.fc.weight.dtype
        device = self.lm_head.device
        root = self.embed(torch.tensor([[st.root]], device=device)).to(dtype)  # [1, 1, H]
        block = self.head.block_inputs(root)  # [1, block_size, H]
        p = st.kv_len
        pos = torch.arange(p, p + cfg.block_size, device=device)[None]
        n = bs.length
        ctx_ok = torch.ones(cfg.block_size, n, dtype=torch.bool, device=device)
        if cfg.sliding_window is not None:
            ctx_ok[:, : max(0, n - cfg.sliding_window)] = False
        own = torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool, device=device)
        if cfg.causal:
            own = own.tril()
        mask = torch.cat([ctx_ok, own], -1)[None, None]
        out = self.head(block, pos, bs.kv, mask)[0, 1:]  # [block_size - 1, H]
        logits = out @ self.head.projection(self.lm_head).to(out.dtype).T
        return torch.log_softmax(logits.float(), -1)

    def propose(self, st: RequestState, tree: TreeSpec) -> Tree:
        logp = self.block_log_probs(st)
        depth = min(tree.depth, logp.shape[0])
        k = min(tree.top_k, logp.shape[-1])
        top = torch.topk(logp[:depth], k, dim=-1)
        values, indices = top.values.tolist(), top.indices.tolist()
        pool = [Node(t, -1, 1, s) for s, t in zip(values[0], indices[0])]
        frontier = list(range(len(pool)))
        for d in range(1, depth):
            cands = []
            for i in frontier:
                for s, t in zip(values[d], indices[d]):
                    pool.append(Node(t, i, d + 1, pool[i].score + s))
                    cands.append(len(pool) - 1)
            frontier = sorted(cands, key=lambda j: -pool[j].score)[:k]
        device = self.lm_head.device
        return select_tree(st.root, pool, tree.total_tokens, lambda ids: self.head.to_target_ids(ids.to(device)))
