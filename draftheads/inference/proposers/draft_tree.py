"""Autoregressive drafting with a one-layer draft model and its own small KV cache, shared by the
EAGLE-1 and EAGLE-3 proposers, with EAGLE-2's dynamic tree.

Draft entry p reads (feature of target position p, embedding of token x_{p+1}) at position p and
predicts x_{p+2}. Committed entries (real target features) live in a per-request KV; tree entries
use the draft's own output as the feature, attend to the committed entries plus their ancestors,
and are discarded after each step.

Dynamic tree: the root's children are its top-k tokens; at every depth the top-k frontier nodes by
cumulative log-probability are expanded into top-k children each; finally all drafted nodes are
reranked by cumulative log-probability and the best ``total_tokens - 1`` kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftheads.inference.proposers.base import FollowingProposer, RequestState
from draftheads.inference.tree import Tree, TreeSpec


@dataclass
class DraftState:
    k: torch.Tensor | None = None  # [1, kv_heads, n, D] committed draft keys
    v: torch.Tensor | None = None
    last_out: torch.Tensor | None = None  # [H] draft output at the last committed entry
    last_logp: torch.Tensor | None = None  # [V'] its log-probabilities (head vocabulary)
    pending: list = field(default_factory=list)  # target hidden states of committed tokens not yet drafted over

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]


@dataclass
class Node:
    token: int  # head-vocabulary index
    parent: int  # pool index, -1 = root
    depth: int
    score: float
    out: torch.Tensor | None = None  # draft output of this node's entry (once expanded)
    entry: int = -1  # index among the step's tree entries


class DraftTreeProposer(FollowingProposer):
    """Subclasses define ``entry_features`` (target hidden states -> draft features) and ``step``
    (one draft forward) plus ``log_probs`` and ``to_target_ids``."""

    state_type = DraftState

    def __init__(self, head, embed: torch.nn.Module):
        super().__init__()
        self.head = head.eval()
        self.embed = embed

    # -- subclass interface ------------------------------------------------

    def entry_features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:  # pragma: no cover
        """[n, H] draft features of committed target positions."""
        raise NotImplementedError

    def step(self, feats, tokens, positions, mask, past_kv, extra_kv):  # pragma: no cover
        """feats [1, n, H], target token ids [1, n], positions [1, n] -> (out [1, n, H], (k, v))."""
        raise NotImplementedError

    def log_probs(self, out: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        """[n, H] -> [n, V'] log-probabilities over the head vocabulary."""
        raise NotImplementedError

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    # -- following the committed sequence (FollowingProposer keeps the hidden states) ---------------

    @torch.no_grad()
    def _catch_up(self, st: RequestState) -> DraftState:
        ds = self.states[st.rid]
        hidden = self.take_pending(st)
        if hidden is None:
            return ds
        first_pos = ds.length
        feats = self.entry_features(hidden)[None]  # [1, n, H]
        n = feats.shape[1]
        assert first_pos + n == st.kv_len, (first_pos, n, st.kv_len)
        tokens = torch.tensor([st.tokens[first_pos + 1: first_pos + 1 + n]], device=feats.device)
        pos = torch.arange(first_pos, first_pos + n, device=feats.device)[None]
        mask = torch.zeros(1, 1, n, first_pos + n, dtype=feats.dtype, device=feats.device)
        mask[..., first_pos:] = torch.full((n, n), float("-inf"), dtype=feats.dtype).triu(1)
        past = (ds.k, ds.v) if ds.k is not None else None
        out, (k, v) = self.step(feats, tokens, pos, mask, past, None)
        ds.k = k if ds.k is None else torch.cat([ds.k, k], 2)
        ds.v = v if ds.v is None else torch.cat([ds.v, v], 2)
        ds.last_out = out[0, -1]
        ds.last_logp = self.log_probs(out[0, -1:])[0]
        return ds

    # -- drafting ------------------------------------------------------------

    @torch.no_grad()
    def propose(self, st: RequestState, tree: TreeSpec) -> Tree:
        ds = self._catch_up(st)
        spec = tree
        k = spec.top_k
        top = torch.topk(ds.last_logp, min(k, ds.last_logp.numel()))
        pool = [Node(int(t), -1, 1, float(s)) for s, t in zip(top.values, top.indices)]
        frontier = list(range(len(pool)))
        entries_k: list[torch.Tensor] = []
        entries_v: list[torch.Tensor] = []
        entry_nodes: list[int] = []
        for depth in range(1, spec.depth):
            # one draft forward over the frontier: each node's entry attends to the committed
            # prefix, its ancestors' entries and itself
            parents_out = torch.stack([
                ds.last_out if pool[i].parent < 0 else pool[pool[i].parent].out for i in frontier
            ])[None]
            tokens = self.to_target_ids(torch.tensor([[pool[i].token for i in frontier]], device=parents_out.device))
            pos = torch.full((1, len(frontier)), ds.length + depth - 1, device=parents_out.device)
            n_extra = len(entry_nodes)
            mask = torch.full((1, 1, len(frontier), ds.length + len(frontier) + n_extra), float("-inf"),
                              dtype=parents_out.dtype, device=parents_out.device)
            mask[..., : ds.length] = 0
            for row, i in enumerate(frontier):
                mask[0, 0, row, ds.length + row] = 0
                a = pool[i].parent
                while a >= 0:
                    mask[0, 0, row, ds.length + len(frontier) + pool[a].entry] = 0
                    a = pool[a].parent
            out, (kk, vv) = self.step(parents_out, tokens, pos, mask, (ds.k, ds.v), (entries_k, entries_v))
            for row, i in enumerate(frontier):
                pool[i].out = out[0, row]
                pool[i].entry = len(entry_nodes)
                entry_nodes.append(i)
            entries_k = entries_k + [kk]
            entries_v = entries_v + [vv]
            logp = self.log_probs(out[0])  # [frontier, V']
            top = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
            cands = []
            for row, i in enumerate(frontier):
                for s, t in zip(top.values[row].tolist(), top.indices[row].tolist()):
                    pool.append(Node(t, i, depth + 1, pool[i].score + s))
                    cands.append(len(pool) - 1)
            frontier = sorted(cands, key=lambda j: -pool[j].score)[:k]
        return self._select(st.root, pool, spec.total_tokens)

    def _select(self, root: int, pool: list[Node], total_tokens: int) -> Tree:
        return select_tree(root, pool, total_tokens, lambda ids: self.to_target_ids(ids.to(self.head_device)))

    @property
    def head_device(self):
        return next(self.head.parameters()).device


def select_tree(root: int, pool: list[Node], total_tokens: int, to_target_ids) -> Tree:
    """The best ``total_tokens - 1`` drafted nodes by cumulative log-probability (with their ancestors),
    as a tree rooted at ``root``; ``to_target_ids`` maps head-vocabulary indices [n] to target ids."""
    keep = sorted(range(len(pool)), key=lambda j: (-pool[j].score, pool[j].depth))[: total_tokens - 1]
    chosen = set(keep)
    for j in keep:  # ancestor closure (scores never grow with depth, but ties may reorder)
        a = pool[j].parent
        while a >= 0 and a not in chosen:
            chosen.add(a)
            a = pool[a].parent
    order = sorted(chosen, key=lambda j: (pool[j].depth, j))
    index = {j: n + 1 for n, j in enumerate(order)}
    ids = to_target_ids(torch.tensor([pool[j].token for j in order], dtype=torch.long)).tolist()
    parents = [-1] + [0 if pool[j].parent < 0 else index[pool[j].parent] for j in order]
    return Tree([root, *ids], parents)
