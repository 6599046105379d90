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

The backbone logits of every block position come from one projection (for every drafting request at
once); subclasses add a bias by the token before each position (:meth:`DFlashProposer.bias`, DSpark's
Markov head) and estimate each draft's survival (:meth:`DFlashProposer.survival`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from draftheads.errors import DraftheadsError
from draftheads.inference.projection import vocab_logits
from draftheads.inference.proposers.base import FollowingProposer, RequestState
from draftheads.inference.proposers.registry import register
from draftheads.inference.sampling import draw, target_probs
from draftheads.inference.tree import Node, Tree, TreeSpec, chain_parents, select_tree


@dataclass
class BlockState:
    kv: list | None = None  # per draft layer (k, v) [1, kv_heads, n, D] of the committed context
    pending: list = field(default_factory=list)  # target hidden states of committed tokens not yet injected

    @property
    def length(self) -> int:
        return 0 if self.kv is None else self.kv[0][0].shape[2]


@register("dflash")
class DFlashProposer(FollowingProposer):
    name = "dflash"
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
        self._weight = None
        self.auto_pool = TreeSpec(depth=head.config.drafts_per_block, top_k=4, total_tokens=32, name="auto")

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

    @property
    def weight(self) -> torch.Tensor:
        """[V', H] the head-vocabulary projection (the own draft head, or the target's lm_head)."""
        if self._weight is None:
            self._weight = self.head.projection(self.lm_head).to(self.head.fc.weight.dtype)
        return self._weight

    def bias(self, prev: torch.Tensor) -> torch.Tensor | None:
        """Additive logits [n, V'] of the positions after the target ids ``prev`` [n]; None: DFlash's
        positions do not depend on the token before (DSpark's Markov head does)."""
        return None

    def survival(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        """Estimated probability [n] that each draft at hidden [n, H] is accepted once the ones before it
        were, given the target ids of the tokens before (prev [n]); None without a confidence estimate."""
        return None

    def _survival_of(self, hidden: torch.Tensor, prev: torch.Tensor) -> float:
        """:meth:`survival` of one draft (hidden [H], prev [1]) as a number, 1 without an estimate."""
        surv = self.survival(hidden[None], prev)
        return 1.0 if surv is None else float(surv[0])

    def _logits(self, base: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """One position's logits [n or 1, V'] after the tokens ``prev``, from its backbone logits [V']."""
        bias = self.bias(prev)
        return base[None] if bias is None else base[None] + bias

    @torch.no_grad()
    def propose(self, st: RequestState, tree: TreeSpec) -> Tree:
        return self.propose_batch([st], tree)[0]

    @torch.no_grad()
    def propose_batch(self, states: list[RequestState], tree: TreeSpec, grow=None) -> list[Tree]:
        """One head forward per request (contexts differ in length), then the backbone logits of every
        request's block positions in one projection; greedy chains are decoded for all requests together,
        with one read-back."""
        outs = [self.block_hidden(st) for st in states]
        depth = min(tree.depth, outs[0].shape[0])
        out = torch.stack([o[:depth] for o in outs])  # [B, depth, H]
        base = vocab_logits(out, self.weight).float()  # [B, depth, V']
        if tree.top_k == 1 and all(st.params.greedy for st in states):
            return self._greedy_chains(states, out, base)
        trees = []
        for st, o, b in zip(states, out, base):
            if tree.top_k == 1 and not st.params.greedy:
                trees.append(self._sampled_chain(st, o, b))
            else:
                trees.append(self._tree(st, o, b, tree))
        return trees

    def _greedy_chains(self, states: list[RequestState], out: torch.Tensor, base: torch.Tensor) -> list[Tree]:
        """Each request's best token per position, left to right (each position biased by the draft before
        it), up to where the running survival estimate falls below ``min_survival``."""
        prev = torch.tensor([st.root for st in states], device=out.device)
        alive = torch.ones(len(states), device=out.device)
        score = torch.zeros(len(states), device=out.device)
        drafts, kept, scores = [], [], []
        for d in range(out.shape[1]):
            surv = self.survival(out[:, d], prev)
            if surv is not None:
                alive = alive * surv
            kept.append(alive >= self.min_survival)
            logits = base[:, d] if (bias := self.bias(prev)) is None else base[:, d] + bias
            best = torch.log_softmax(logits, -1).max(-1)
            # a draft's confidence: the confidence head's survival where there is one, else its probability
            score = alive.clamp(min=1e-30).log() if surv is not None else score + best.values
            scores.append(score)
            prev = self.head.to_target_ids(best.indices)
            drafts.append(prev)
        tokens = torch.stack(drafts, 1).tolist()
        conf = torch.stack(scores, 1).tolist()
        lengths = torch.stack(kept, 1).cumprod(1).sum(1).tolist()  # a chain stops at its first cut
        return [Tree([st.root, *t[:n]], chain_parents(n), scores=[0.0, *c[:n]])
                for st, t, c, n in zip(states, tokens, conf, lengths)]

    def _tree(self, st: RequestState, out: torch.Tensor, base: torch.Tensor, tree: TreeSpec) -> Tree:
        """The top-k tree over the block's positions (out [depth, H], their backbone logits base
        [depth, V']), as deep as the drafts survive."""
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
            survival *= self._survival_of(out[d], prev[:1])  # along the best path
            if survival < self.min_survival:
                break
            logp = torch.log_softmax(self._logits(base[d], prev), -1)
            top = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
            values, indices = top.values.tolist(), top.indices.tolist()
            cands = []
            for row, parent in enumerate(frontier or [-1]):
                r = row if len(values) > 1 else 0  # DFlash: one distribution for every parent
                vs, ts = values[r], indices[r]
                score = pool[parent].score if parent >= 0 else 0.0
                for v, t in zip(vs, ts):
                    pool.append(Node(t, parent, d + 1, score + v))
                    cands.append(len(pool) - 1)
            frontier = sorted(cands, key=lambda j: -pool[j].score)[:k]
        if not pool:
            return Tree([st.root], [-1])
        return select_tree(st.root, pool, tree.total_tokens, lambda ids: self.head.to_target_ids(ids.to(out.device)))

    def _sampled_chain(self, st: RequestState, out: torch.Tensor, base: torch.Tensor) -> Tree:
        """A chain drawn left to right from the head's distributions under the request's sampling
        parameters, each draft's q kept so verification runs the rejection walk."""
        prev_ids = lambda prev: torch.tensor([prev], device=out.device)  # noqa: E731
        step = lambda d, prev: self._logits(base[d], prev_ids(prev))[0]  # noqa: E731
        cut = lambda d, prev: self._survival_of(out[d], prev_ids(prev))  # noqa: E731
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
    tokens, qs, scores = [root], [None], [0.0]
    alive = 1.0
    for d in range(depth):
        if survival is not None:
            alive *= survival(d, tokens[-1])
            if alive < min_survival:
                break
        q = to_target_probs(target_probs(step_logits(d, tokens[-1]), params))
        # confidence from q alone (the chance two draws agree), never from the token drawn: the policy
        # cuts sampled chains by it
        scores.append(scores[-1] + math.log(max(float(q.square().sum()), 1e-30)))
        tokens.append(draw(q, generator))
        qs.append(q)
    return Tree(tokens, chain_parents(len(tokens) - 1), qs, scores)
