"""DFlash proposer: one draft forward per step gives a whole block of per-position distributions.

The context keys and values of committed tokens are kept per request and layer (computed from the
target's hidden states when a draft is next asked for, one forward for all that arrived, so plain
steps cost nothing). A step runs the block ``[root, MASK x (block_size - 1)]`` at positions
P .. P + block_size - 1 (P = the root's position) against them, and reads log-probabilities for the
positions P + 1 .. P + block_size - 1.

* Chain (``top_k == 1``): the best token at each position, up to the tree's depth; when sampling,
  each position's token drawn from the head's distribution under the request's sampling parameters,
  its q kept on the node so verification runs the rejection walk (:func:`sample_chain`).
* Tree over the block: the block's positions are drafted independently of each other, so a candidate
  at depth d is any of position d's top-k tokens after any kept node at depth d - 1, scored by the sum
  of log-probabilities along its path. At each depth the ``top_k`` best frontier nodes are expanded,
  then the best ``total_tokens - 1`` nodes are kept (the EAGLE-2 selection, on one forward's output).

Subclasses change a position's logits by the token before it (:meth:`DFlashProposer.logits`, DSpark's
Markov head) and estimate each draft's survival (:meth:`DFlashProposer.survival_cut`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftheads.errors import DraftheadsError
from draftheads.inference.proposers.base import FollowingProposer, RequestState
from draftheads.inference.sampling import target_probs
from draftheads.inference.tree import Node, Tree, TreeSpec, chain_parents, select_tree


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

    def __init__(self, head, target, min_survival: float = 0.0):
        """``min_survival``: drafts are cut where the estimated probability that they survive verification
        falls below it (heads with a confidence estimate)."""
        super().__init__()
        self.min_survival = min_survival
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
    def block_hidden(self, st: RequestState) -> torch.Tensor:
        """[drafts_per_block, H] head outputs of the block's drafting slots (one head forward)."""
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
        return self.head(block, pos, bs.kv, mask)[0, cfg.first_draft_slot:]

    def logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """One block position's logits over the head vocabulary: hidden [H], target ids of the tokens
        before it [n] -> [n or 1, V'] (DFlash's positions do not depend on the token before)."""
        return (hidden @ self.head.projection(self.lm_head).to(hidden.dtype).T)[None].float()

    def survival_cut(self, hidden: torch.Tensor, prev: torch.Tensor) -> float:
        """Estimated probability that this position's draft is accepted once the ones before it were,
        given the target id of the token before it (prev [1]); 1 without a confidence estimate."""
        return 1.0

    @torch.no_grad()
    def propose(self, st: RequestState, tree: TreeSpec) -> Tree:
        out = self.block_hidden(st)
        depth = min(tree.depth, out.shape[0])
        if tree.top_k == 1 and not st.params.greedy:
            return self._sampled_chain(st, out[:depth])
        return self._tree(st, out[:depth], tree)

    def _tree(self, st: RequestState, out: torch.Tensor, tree: TreeSpec) -> Tree:
        """The top-k tree over the block's positions (a chain at top_k 1), as deep as the drafts survive."""
        k = tree.top_k
        pool: list[Node] = []
        frontier: list[int] = []  # pool indices of the nodes expanded at this depth (the root: none)
        survival = 1.0
        for d in range(out.shape[0]):
            # target ids of the frontier's tokens (the best first), on the device, for the Markov bias
            if frontier:
                prev = self.head.to_target_ids(torch.tensor([pool[i].token for i in frontier], device=out.device))
            else:
                prev = torch.tensor([st.root], device=out.device)
            survival *= self.survival_cut(out[d], prev[:1])  # along the best path
            if survival < self.min_survival:
                break
            logp = torch.log_softmax(self.logits(out[d], prev), -1)
            top = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
            values, indices = top.values.tolist(), top.indices.tolist()
            cands = []
            for row, parent in enumerate(frontier or [-1]):
                r = row if len(values) > 1 else 0  # DFlash: one distribution for every parent
                vs, ts = values[r], indices[r]
                base = pool[parent].score if parent >= 0 else 0.0
                for v, t in zip(vs, ts):
                    pool.append(Node(t, parent, d + 1, base + v))
                    cands.append(len(pool) - 1)
            frontier = sorted(cands, key=lambda j: -pool[j].score)[:k]
        if not pool:
            return Tree([st.root], [-1])
        return select_tree(st.root, pool, tree.total_tokens, lambda ids: self.head.to_target_ids(ids.to(out.device)))

    def _sampled_chain(self, st: RequestState, out: torch.Tensor) -> Tree:
        """A chain drawn left to right from the head's distributions under the request's sampling
        parameters, each draft's q kept so verification runs the rejection walk."""
        step = lambda d, prev: self.logits(out[d], torch.tensor([prev], device=out.device))[0]  # noqa: E731
        cut = lambda d, prev: self.survival_cut(out[d], torch.tensor([prev], device=out.device))  # noqa: E731
        return sample_chain(st.root, out.shape[0], step, st.params, st.generator, self._scatter, cut,
                            self.min_survival)

    def _scatter(self, probs: torch.Tensor) -> torch.Tensor:
        """Head-vocabulary probabilities [V'] -> target-vocabulary probabilities [V]."""
        if self.head.config.draft_vocab_size is None:
            return probs
        full = probs.new_zeros(self.head.config.vocab_size)
        return full.index_copy_(0, self.head.to_target_ids(torch.arange(probs.numel(), device=probs.device)), probs)


def sample_chain(root: int, depth: int, step_logits, params, generator, to_target_probs=lambda p: p,
                 survival=None, min_survival: float = 0.0) -> Tree:
    """A chain of up to ``depth`` drafts rooted at ``root``, drawn left to right: draft d from
    ``q_d = target_probs(step_logits(d, previous token), params)``; its q (over the target vocabulary, by
    ``to_target_probs``) goes on the node for the rejection walk. ``survival(d, prev)`` estimates that
    draft d is accepted once the ones before it were; the chain stops where the running product falls
    below ``min_survival``."""
    tokens, qs = [root], [None]
    alive = 1.0
    for d in range(depth):
        if survival is not None:
            alive *= survival(d, tokens[-1])
            if alive < min_survival:
                break
        q = to_target_probs(target_probs(step_logits(d, tokens[-1]), params))
        tokens.append(int(torch.multinomial(q, 1, generator=generator)))
        qs.append(q)
    return Tree(tokens, chain_parents(len(tokens) - 1), qs)
