"""Autoregressive drafting with a draft model of one or more layers, batched over the engine's rows, shared by the
EAGLE-1 and EAGLE-3 proposers, with EAGLE-2's dynamic tree.

Draft entry p reads (feature of target position p, embedding of token x_{p+1}) at position p and
predicts x_{p+2}. Committed entries (real target features) stay in a preallocated :class:`DraftKV`;
a step's tree entries use the draft's own output as the feature, are written after each row's
committed entries, attend to those plus their ancestors, and are overwritten by the next step.

Dynamic tree, for all rows at once: the root's children are its top-k tokens; at every depth the
top-k frontier nodes by cumulative log-probability are expanded into top-k children each (one draft
forward over ``[rows, top_k]`` entries); finally all drafted nodes are reranked by cumulative
log-probability and the best ``total_tokens - 1`` kept (:func:`select_nodes`). Everything stays on
the device until the chosen trees are read back, once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence

from draftheads.inference.draft_kv import DraftKV
from draftheads.inference.projection import vocab_logits
from draftheads.inference.proposers.base import FollowingProposer, Growth, RequestState
from draftheads.inference.tree import Tree, TreeSpec, select_nodes


@dataclass
class DraftState:
    last_out: torch.Tensor | None = None  # [H] draft output at the last committed entry
    last_logp: torch.Tensor | None = None  # [V'] its log-probabilities (head vocabulary)
    pending: list = field(default_factory=list)  # target hidden states of committed tokens not yet drafted over


# what one draft forward costs besides its padded rows, in tokens of them: little on a CPU, where the work
# grows with the tokens; much on an accelerator, where a small head's forward is mostly its launches
CATCH_UP_OVERHEAD = {"cpu": 32, "accelerator": 4096}


def length_groups(sizes: list[int], overhead: int) -> list[list[int]]:
    """Indices of ``sizes`` split into groups, each one forward padded to its longest, at the least cost:
    a group of rows costs ``overhead`` plus its rows times its longest. The best split takes the rows in
    order of length (a dynamic programme over the cut points), so a few long prompts do not pad the rest.
    Where all the padding costs no more than one forward, as on most drafted steps (each row catching up
    over the few tokens its last step accepted), that is one forward, without the programme."""
    order = sorted(range(len(sizes)), key=sizes.__getitem__)
    if sizes and len(sizes) * max(sizes) - sum(sizes) <= overhead:  # no split saves a forward's cost
        return [order]
    s = [sizes[i] for i in order]
    cost, cut = [0] + [float("inf")] * len(s), [0] * (len(s) + 1)
    for j in range(1, len(s) + 1):
        for i in range(j):
            c = cost[i] + overhead + (j - i) * s[j - 1]
            if c < cost[j]:
                cost[j], cut[j] = c, i
    groups, j = [], len(s)
    while j:
        groups.append(order[cut[j]: j])
        j = cut[j]
    return groups[::-1]


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [R, T, S] -> additive mask [R, 1, T, S]."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))[:, None]


class DraftTreeProposer(FollowingProposer):
    """Subclasses set ``layer_ids`` and define ``entry_features`` (target hidden states -> draft features).
    The head embeds tokens with the target's embedding and projects its normed output through
    ``head.projection`` (its own draft vocabulary, or the target's lm_head)."""

    state_type = DraftState
    width_by_rows = True

    def __init__(self, head, target):
        super().__init__()
        self.head = head.eval()
        self.embed = target.get_input_embeddings()
        self.weight = head.projection(target.get_output_embeddings().weight)  # [V', H]
        attn = head.layers[0].self_attn
        weight = next(head.parameters())
        self.kv = DraftKV(attn.kvh, attn.d, weight.dtype, weight.device, layers=len(head.layers))

    # -- subclass interface ------------------------------------------------

    def entry_features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:  # pragma: no cover
        """[n, H] draft features of committed target positions."""
        raise NotImplementedError

    def step(self, feats, tokens, positions, mask, cache):
        """feats [R, T, H], target token ids [R, T], positions [R, T], additive mask [R, 1, T, S], a
        :class:`~draftheads.inference.draft_kv.DraftStep` -> (out [R, T, H], new (k, v))."""
        return self.head(self.embed(tokens).to(feats.dtype), feats, positions, mask=mask, cache=cache)

    def log_probs(self, out: torch.Tensor) -> torch.Tensor:
        """[n, H] -> [n, V'] log-probabilities over the head vocabulary."""
        return torch.log_softmax(vocab_logits(self.head.normed(out), self.weight).float(), -1)

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.to_target_ids(ids)

    # -- following the committed sequence (FollowingProposer keeps the hidden states) ---------------

    def start(self, st: RequestState, hidden) -> None:
        super().start(st, hidden)
        self.kv.add(st.rid)

    def finish(self, st: RequestState) -> None:
        if st.rid in self.kv.slot:
            self.kv.release(st.rid)
        super().finish(st)

    @torch.no_grad()
    def _catch_up(self, states: list[RequestState]) -> None:
        """Draft forwards over every row's committed tokens not yet drafted over, writing their entries
        into the draft KV: rows of similar lengths share a forward, padded to their longest
        (:func:`length_groups`; a batch's prompts differ in length several times over)."""
        rows = [(st, h) for st in states if (h := self.take_pending(st)) is not None]
        if not rows:
            return
        feats = [self.entry_features(h) for _, h in rows]  # each [n, H]
        overhead = CATCH_UP_OVERHEAD["cpu" if feats[0].device.type == "cpu" else "accelerator"]
        for group in length_groups([f.shape[0] for f in feats], overhead):
            self._catch_up_rows([rows[i][0] for i in group], [feats[i] for i in group])

    def _catch_up_rows(self, states: list[RequestState], feats: list[torch.Tensor]) -> None:
        """One draft forward over these rows' pending entries, ``feats`` (each [n, H]) padded to the longest."""
        sizes = [f.shape[0] for f in feats]
        firsts = [self.kv.length[st.rid] for st in states]
        for st, first, n in zip(states, firsts, sizes):
            assert first + n == st.kv_len, (first, n, st.kv_len)
        width = max(sizes)
        device = feats[0].device
        tokens = torch.tensor([st.tokens[f + 1: f + 1 + n] + [0] * (width - n)
                               for st, f, n in zip(states, firsts, sizes)], device=device)
        pos = torch.tensor(firsts, device=device)[:, None] + torch.arange(width, device=device)  # [R, T]
        keys = max(firsts) + width
        visible = torch.arange(keys, device=device)[None, None] <= pos[:, :, None]  # causal over own entries
        cache = self.kv.step([st.rid for st in states], pos, keys)
        x = pad_sequence(feats, batch_first=True)  # [R, T, H]
        out, _ = self.step(x, tokens, pos, _additive(visible, x.dtype), cache)
        last = out[torch.arange(len(states), device=device), torch.tensor(sizes, device=device) - 1]  # [R, H]
        logp = self.log_probs(last)
        for i, st in enumerate(states):
            self.kv.length[st.rid] = st.kv_len
            ds = self.states[st.rid]
            ds.last_out, ds.last_logp = last[i], logp[i]

    # -- drafting ------------------------------------------------------------

    def propose(self, st: RequestState, tree: TreeSpec) -> Tree:
        return self.propose_batch([st], tree)[0]

    @torch.no_grad()
    def propose_batch(self, states: list[RequestState], tree: TreeSpec, grow: Growth | None = None) -> list[Tree]:
        self._catch_up(states)
        rids = [st.rid for st in states]
        lengths = [self.kv.length[r] for r in rids]
        ds = [self.states[r] for r in rids]
        last_out = torch.stack([d.last_out for d in ds])  # [R, H]
        last_logp = torch.stack([d.last_logp for d in ds])  # [R, V']
        r, hidden = last_out.shape
        device = last_out.device
        k = min(tree.top_k, last_logp.shape[-1])
        lens = torch.tensor(lengths, device=device)  # [R]
        top = torch.topk(last_logp, k)
        # the pool, as per-depth pieces [R, n]: head-vocabulary token, cumulative score, parent (pool index), depth
        tok, score, par, dep = [top.indices], [top.values.clamp(max=0)], [torch.full((r, k), -1, device=device)], [1]
        frontier = torch.arange(k, device=device).expand(r, k)  # pool indices being expanded
        f_tok, f_score, f_in = top.indices, score[0], last_out[:, None].expand(r, k, hidden)
        entries = (tree.depth - 1) * k
        anc = torch.zeros(r, max(entries, 1), max(entries, 1), dtype=torch.bool, device=device)  # entry ancestry
        f_anc = torch.zeros(r, k, anc.shape[2], dtype=torch.bool, device=device)  # entries above each frontier node
        size = k
        for d in range(1, tree.depth):
            if grow is not None and not grow.more(d, score[-1], par[-1]):
                break
            # the frontier becomes entries e0 .. e0 + k - 1; each sees the committed prefix and its ancestors
            e0 = (d - 1) * k
            own = torch.arange(e0, e0 + k, device=device)
            anc[:, own] = f_anc
            anc[:, own, own] = True
            keys = max(lengths) + e0 + k
            rel = torch.arange(keys, device=device)[None] - lens[:, None]  # [R, S] key position after the prefix
            tail = anc[:, own].gather(2, rel.clamp(0, entries - 1)[:, None].expand(r, k, keys))
            visible = (rel < 0)[:, None] | (tail & (rel < e0 + k)[:, None])  # [R, k, S]
            cache = self.kv.step(rids, lens[:, None] + own, keys)
            pos = (lens + d - 1)[:, None].expand(r, k)
            out, _ = self.step(f_in, self.to_target_ids(f_tok), pos, _additive(visible, f_in.dtype), cache)
            logp = self.log_probs(out.reshape(r * k, hidden)).view(r, k, -1)
            top = torch.topk(logp, k, dim=-1)  # [R, k, k]
            c_score = (f_score[:, :, None] + top.values.clamp(max=0)).reshape(r, k * k)
            c_tok = top.indices.reshape(r, k * k)
            tok.append(c_tok)
            score.append(c_score)
            par.append(frontier[:, :, None].expand(r, k, k).reshape(r, k * k))
            dep.append(d + 1)
            best = torch.sort(c_score, dim=1, descending=True, stable=True).indices[:, :k]  # [R, k]
            frontier = size + best
            size += k * k
            f_tok, f_score = c_tok.gather(1, best), c_score.gather(1, best)
            f_anc = anc.gather(1, (e0 + best // k)[:, :, None].expand(r, k, entries))
            f_in = out.gather(1, (best // k)[:, :, None].expand(r, k, hidden))
        depth = torch.cat([torch.full_like(t, n) for t, n in zip(tok, dep)], 1)
        nodes, parents = select_nodes(torch.cat(score, 1), depth, torch.cat(par, 1), tree.total_tokens - 1)
        ids = self.to_target_ids(torch.cat(tok, 1).gather(1, nodes))
        kept = torch.cat(score, 1).gather(1, nodes)
        host = torch.stack([ids.double(), parents.double(), kept.double()]).tolist()  # the step's one read-back
        return [Tree([st.root, *map(int, t)], [-1, *map(int, p)], scores=[0.0, *s])
                for st, t, p, s in zip(states, host[0], host[1], host[2])]

    @property
    def head_device(self):
        return next(self.head.parameters()).device
