"""``--tree auto``: each step drafts the tree with the best expected tokens per second, plain decoding
included, from two models kept as the engine runs.

* **Acceptance** (:class:`~draftheads.inference.acceptance.AcceptanceModel`): the probability that a
  drafted node is accepted, from the draft's own confidence in each token of its path, calibrated on
  every drafted node the emitted tokens label (those the step left out included), shared by the
  engine's requests and refined per request.
* **Cost** (:mod:`draftheads.inference.cost`): seconds of the verify forward by batch size and query
  tokens (a verify curve per batch size, with a drift factor for the machine's speed) and of drafting
  by batch size and depth;
  and here, the seconds of one level of the verification walk (the lazy lm_head projects the nodes of
  one depth at a time, so a walk costs one projection per accepted depth and the bonus).

A step, for a batch of ``B`` rows:

1. **What a row's tokens are worth** (:func:`worth`): a batch is done when its last row is, so a token
   of a row sure to finish before the others is worth less than one of the row furthest behind; worths
   sum to ``B`` (all rows alike: 1 each), and a row worth less than a tenth of the last one's does not
   draft. Tokens below are counted at their row's worth.
2. **Who drafts.** A row drafts unless its gate is shut. Each drafted step credits the row with the
   seconds its accepted tokens saved the batch (accepted tokens times its worth times plain decoding's
   seconds per token) and
   charges it its share of the draft (as the draft cost model has it: a request's first draft also
   reads its prompt, once) and of the verify forward beyond plain; when the decayed mean of
   the credit falls below that of the charge, and so do the seconds the acceptance model, having seen
   this step, expects the row's tree to save (one unlucky step of a good drafter does not shut it; a
   drafter the model believes in no longer does), the row decodes plainly and probes again after a wait
   that doubles on every losing probe, up to ``max_wait`` steps: a request whose drafts turn good
   finds out within that bound. A new request drafts at once if the acceptance the engine's requests
   have shown so far (the shared cells) expects a chain of some depth to save the batch more than its
   share of that step's draft and verify; otherwise it waits as long as the last finished request last
   waited (its first draft also reads its whole prompt: with a weak drafter at batch 16, twice a plain
   step) and then probes, so a prompt on which the drafter is good is still found within ``max_wait``. Should a first probe lose,
   the next wait doubles from the last request's, so a drafter that did not pay on the requests before
   costs a new one a probe or two rather than one every few steps. A row drafts only while it can take
   a drafted token (more than one token to go), and no node deeper than it can take is valued.

   **And whether the batch drafts at all.** The rows' gates each see their share of a step, and each
   probe starts a row's means afresh; what drafting costs a batch size is also its probes and the parts
   of a step no row alone pays (a tree's forward builds its attention mask once). So a gate per batch
   size, the same as a row's, weighs every drafted step as a whole: the tokens it accepted (at plain
   decoding's seconds per token) against what it cost beyond a plain step, the verify as measured and
   the draft as the draft cost model has it (a request's first draft reads its prompt once: not a step's
   cost); a step whose forward ran its shapes cold is not judged. Its means run on through probes, so
   one lucky probe does not reopen a batch size where drafting loses. Where drafting loses on the mean
   of its steps and the trees drafted are not believed to pay either (the acceptance model having seen
   the step), the batch decodes plainly and probes again after the doubling wait; the rows' own waits
   run meanwhile. A step believed to pay keeps the batch drafting, but only its mean paying starts its
   waits over, so a batch size that loses probes further and further apart. A shut batch is probed by a
   quarter of the rows that would draft (``probe_share``, but at least ``probe_least``: the step of one
   row says little, so a batch of 4 probes whole; those the acceptance model likes best), so that the
   others' drafters need not read every token since they last drafted (a new request's whole prompt)
   for a probe that loses; the probe is judged as the step of all those rows it
   stands for (its tokens, believed and accepted, and its verify beyond plain, scaled by their number;
   the draft as the draft cost model prices it for all of them), and it stays out of the means. A batch
   of one row is its row's gate.
3. **How deep** (:class:`Grow`, proposers that draft depth by depth): each depth is a draft forward
   over rows × width tokens, so the width (``top_k``) shrinks as more rows draft, to the pool's
   ``top_k`` over the rows (at least 1): the rows together read what one row reads at full width (on
   2 CPU cores, top-4 drafts at batch 4 cost more than their extra tokens returned). After each depth, the chance
   that the walk reaches it (the values of its best ``top_k`` nodes, each its parent's times its own)
   times the chance that it goes on one further is what one more depth returns; the draft goes deeper while that return per second of
   drafting and verifying beats the step's rate so far.
4. **Which nodes** (:meth:`AutoPolicy.select`): every drafted node of every row is valued by the
   acceptance model, and the ``n`` best across the batch are verified, ``n`` (0 = plain verify) chosen
   for the best ``(B + sum of their values at their rows' worth) / (draft seconds + verify seconds of B + n tokens + walk
   seconds of 1 + the longest expected walk)``. So the
   tree's size and shape, per row, follow the draft's confidence and what tokens cost here, not a preset.
   A probing row keeps at least its best node, so that it is measured.
5. **Keeping the cost model current**: plain steps are run at a batch size until its curve has measured
   a plain forward itself (the first forward of a size runs its shapes cold and is not counted), and
   then every ``plain_every`` steps of it. Its other sizes are judged by the curve it borrows from the
   nearest batch size measured, at the level its own forwards show; a borrowed plain point would price
   plain decoding at ``B`` rows by a tree of as many tokens over fewer rows, a forward of another shape.

**Selection bias.** Choosing the nodes whose estimated values are highest picks, among nodes of equal worth,
those whose estimates happen to run high, so the chosen trees accept less than their values sum to (the
winner's curse; more so where the acceptance cells hold few observations). Per batch size the policy keeps
the decayed accepted tokens of the chosen trees against what their values predicted, and scales the values
it chooses and grows by by that ratio (``bias``), so the predicted tokens of the trees chosen match the
measured, and a tree is not grown for tokens it will not get.

The expected tokens of a chosen tree are predicted before it is verified (``report``: predicted against
measured tokens per step, and the sizes chosen).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import torch

from draftheads.inference.acceptance import EDGES, AcceptanceModel
from draftheads.inference.cost import BatchCurves, CostCurve, DraftCost, grid_key
from draftheads.inference.proposers.base import RequestState
from draftheads.inference.tree import Tree, TreeSpec, depths, prune


@dataclass
class RowGate:
    """A request's gate: decayed seconds saved and spent per drafted step, and when to probe again."""

    saved: float | None = None
    spent: float | None = None
    open_at: int = 0  # engine step from which the row drafts again
    wait: int = 0  # steps of the last shut-off (0 while drafting pays)
    probing: bool = True  # its next drafted step is a probe (a new request, or after a wait)
    fresh: bool = True  # not yet judged: a new request's first chance to draft


@dataclass
class StepPlan:
    """One step's choice before drafting: the rows that draft, the largest tree asked of the proposer,
    and the depth-by-depth decision."""

    drafting: list[RequestState]
    spec: TreeSpec | None
    grow: Grow | None = None
    weights: dict[int, float] = field(default_factory=dict)  # request id -> what its tokens are worth (1: all alike)
    predicted: float = 0.0  # expected tokens of the trees chosen (filled by select)
    predicted_seconds: float = 0.0  # the verify forward and walk of the trees chosen, as modelled (by select)
    pools: dict[int, Tree] = field(default_factory=dict)  # request id -> its drafted pool (filled by select)
    probe_of: int = 0  # a probe of a shut batch by a few of its rows: the rows that would draft otherwise


@dataclass
class Grow:
    """Decides, depth by depth, whether a step drafts one level further (see the module docstring)."""

    policy: AutoPolicy
    rows: list[RequestState]
    batch: int
    top_k: int
    max_depth: int
    weights: list[float] | None = None  # per row of ``rows``: what its tokens are worth (see :func:`worth`)
    t0: float = field(default_factory=time.perf_counter)
    expected: float = 0.0  # expected accepted tokens over the batch so far
    nodes: int = 0  # tokens to verify beyond the roots so far (each depth's best top_k per row)
    longest: float = 0.0  # a rough expected length of the batch's longest walk so far
    times: dict[int, float] = field(default_factory=dict)  # depth -> seconds since drafting began
    scores: torch.Tensor | None = None  # [R, n] cumulative scores of every node drafted so far, in order
    values: torch.Tensor | None = None  # [R, n] their values

    def more(self, depth: int, scores: torch.Tensor, parents: torch.Tensor) -> bool:
        self.times[depth] = time.perf_counter() - self.t0  # measured, for the draft cost model
        if depth >= self.max_depth:
            return False
        pol, acc = self.policy, self.policy.acceptance
        scores = scores.float()
        if self.scores is None:
            above, up = torch.zeros_like(scores), torch.ones_like(scores)
        else:
            idx = parents.long().clamp(min=0)
            above, up = self.scores.gather(1, idx), self.values.gather(1, idx)
        table = torch.tensor([acc.rates(st.rid, depth) for st in self.rows], device=scores.device)  # [R, bins]
        edges = torch.tensor(EDGES, device=scores.device)
        bins = torch.bucketize((scores - above).clamp(max=0).exp(), edges, right=True)
        values = up * table.gather(1, bins)
        self.scores = scores if self.scores is None else torch.cat([self.scores, scores], 1)
        self.values = values if self.values is None else torch.cat([self.values, values], 1)
        # per row, the chance that the walk reaches this depth on one of its best top_k nodes
        best = torch.topk(values, min(self.top_k, values.shape[1]), dim=1).values
        reach = (best.sum(1) * pol.scale(self.batch)).clamp(max=1.0).tolist()
        w = self.weights or [1.0] * len(self.rows)
        self.expected += sum(p * x for p, x in zip(reach, w))  # accepted tokens at their rows' worth
        self.longest = max(self.longest, max(reach) * depth)  # a walk of a row that reaches this depth
        self.nodes += len(self.rows) * best.shape[1]
        b, r = self.batch, len(self.rows)
        q = b + self.nodes
        limit = pol.curves.at(b).reach()
        if limit is not None and b + r * (depth + 1) > limit:  # a chain one deeper per row would not fit
            return False
        t_v, plain, proj = pol.verify_time(q, b), pol.verify_time(b, b), pol.walk_time(b)
        d_now = pol.draft.estimate(r, depth, plain)
        rate = (b + self.expected) / (d_now + t_v + proj * (1 + self.longest))
        # one more depth opens the ones after it: drafting h further depths pays when what they return
        # per second beats the step's rate so far, for some h
        gain = levels = 0.0
        for h in range(1, self.max_depth - depth + 1):
            reach = [p * acc.reach(st.rid, depth + h) for st, p in zip(self.rows, reach)]
            gain += sum(p * x for p, x in zip(reach, w))
            levels += max(reach)  # the walk's expected further levels, at the batch's longest row
            extra = (max(pol.draft.estimate(r, depth + h, plain) - d_now, 0.0)
                     + max(pol.verify_time(q + h * r, b) - t_v, 0.0) + proj * levels)
            if extra <= 0 or gain / extra > rate:
                return gain > 0
        return False


@dataclass
class AutoPolicy:
    """The ``auto`` policy of one engine (see the module docstring). ``pool``: the largest tree a step
    may draft (the proposer's ``auto_pool``)."""

    pool: TreeSpec
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)
    curves: BatchCurves = field(default_factory=BatchCurves)
    draft: DraftCost = field(default_factory=DraftCost)
    ema: float = 0.1  # weight of a step in a row's gate (a short run of rejections does not shut it)
    min_wait: int = 1
    probe_share: float = 0.25  # the share of its rows that probe a shut batch,
    probe_least: int = 4  # but at least these (one row's probe says little: a batch of 4 probes whole)
    max_wait: int = 32
    plain_every: int = 64
    spread: float = 1.5  # a row this many square roots of the tokens to go ahead of the last is worth 1/e of it
    least: float = 0.1  # a row worth less than this share of the last one does not draft
    narrow: bool = False  # the draft narrows as more rows draft (module docstring, "How deep")
    walk_decay: float = 0.95
    bias_decay: float = 0.98
    bias_weight: float = 4.0  # pseudo accepted tokens of an unbiased start
    last_wait: int = 0  # the last wait of the last request to finish (a new request's first, if it loses)
    last_plain: dict[int, int] = field(default_factory=dict)  # batch key -> engine step of its last plain step
    gates: dict[int, RowGate] = field(default_factory=dict)  # batch key -> whether its batch drafts at all
    walk: dict[int, list[float]] = field(default_factory=dict)  # batch key -> [decayed seconds, decayed levels]
    stats: dict[int, dict[str, float]] = field(default_factory=dict)  # batch key -> report counters
    bias: dict[int, list[float]] = field(default_factory=dict)  # batch key -> [decayed accepted, decayed predicted]

    @classmethod
    def for_proposer(cls, proposer) -> AutoPolicy:
        return cls(proposer.auto_pool, narrow=proposer.width_by_rows)

    # ------------------------------------------------------------------ requests

    def start(self, st: RequestState) -> None:
        st.gate = RowGate(wait=self.last_wait // 2)
        self.acceptance.start(st.rid)

    def finish(self, st: RequestState) -> None:
        self.last_wait = st.gate.wait
        self.acceptance.finish(st.rid)

    # ------------------------------------------------------------------ the step

    @property
    def curve(self) -> CostCurve:
        """Batch 1's verify curve (the one ``draftheads profile`` seeds)."""
        return self.curves.base

    def verify_time(self, tokens: int, batch: int) -> float:
        """Seconds of a verify forward of ``tokens`` query tokens over ``batch`` rows (optimistic; 1 before
        any measurement)."""
        t = self.curves.at(batch).optimistic(tokens)
        return 1.0 if t is None else t

    def scale(self, batch: int) -> float:
        """Accepted over predicted tokens of the trees chosen at this batch size (see selection bias)."""
        got, want = self.bias.get(grid_key(batch), (0.0, 0.0))
        return min(max((got + self.bias_weight) / (want + self.bias_weight), 0.25), 2.0)

    def plan(self, live: list[RequestState], step: int) -> StepPlan:
        """Which rows draft this step (none: a plain step)."""
        b = len(live)
        key = grid_key(b)
        stale = step - self.last_plain.setdefault(key, step) >= self.plain_every  # a new batch size: not yet
        if stale or not self.curves.at(b).measured_at(b):
            # drafting is weighed against a plain step at this batch size: measured here before the first draft
            return StepPlan([], None)
        weights = worth(live, self.spread, self.least)
        rows = [st for st in live if step >= st.gate.open_at and _room(st) > 0 and st.rid in weights]
        fresh = [st for st in rows if st.gate.fresh]
        for st in fresh:
            st.gate.fresh = False
            if not self._likely_pays(st, b, weights[st.rid], len(rows)):
                self._shut(st.gate, step)
        if fresh:
            rows = [st for st in rows if step >= st.gate.open_at]
        if not rows:
            return StepPlan([], None)
        gate = self.gates.setdefault(key, RowGate())
        if b > 1 and step < gate.open_at:  # drafting lost at this batch size
            self.stats.setdefault(key, dict.fromkeys(STATS, 0.0))["held"] += 1
            return StepPlan([], None)
        spec, of = self.pool, len(rows)
        if self.narrow and of > 1:  # rows x width tokens per depth: at most one row's full width
            spec = replace(spec, top_k=max(spec.top_k // of, 1))
        few = max(int(of * self.probe_share), self.probe_least, 1)
        if b > 1 and gate.probing and gate.saved is not None and few < of:
            # a shut batch is probed by the rows likeliest to pay: the others' drafters need not catch up
            rows = sorted(rows, key=lambda st: (-self.acceptance.reach(st.rid, 1), st.rid))[:few]
        else:
            of = 0
        grow = Grow(self, rows, b, spec.top_k, min(spec.depth, max(map(_room, rows))),
                    weights=[weights[st.rid] for st in rows])
        return StepPlan(rows, spec, grow, weights=weights, probe_of=of)

    def select(self, live: list[RequestState], plan: StepPlan, pools: list[Tree], draft_seconds: float) -> list[Tree]:
        """Every live row's tree to verify: the best nodes of the drafted ``pools`` (one per drafting row)
        across the batch, as many as pay (the root alone for rows that did not draft)."""
        b = len(live)
        f = self.scale(b)
        values, cands = {}, []  # cands: (value as its row's tokens are worth, score, depth, row id, node, value)
        pool_of = plan.pools = {st.rid: t for st, t in zip(plan.drafting, pools)}
        for st, t in zip(plan.drafting, pools):
            d, room = depths(t.parents), _room(st)  # a node deeper than the tokens left to go is worth nothing
            values[st.rid] = [v * f if d[i] <= room else 0.0 for i, v in enumerate(self.acceptance.values(st.rid, t))]
            sc = t.scores or [0.0] * len(t)
            w = plan.weights.get(st.rid, 1.0)
            cands.extend((values[st.rid][i] * w, sc[i], d[i], st.rid, i, values[st.rid][i]) for i in range(1, len(t)))
        # equal values (one calibration cell) are ranked by the draft's own score, as EAGLE-2 ranks them; a
        # node's score is below its parent's, so a parent still comes first
        cands.sort(key=lambda c: (-c[0], -c[1], c[2], c[3], c[4]))  # a parent is worth as much as its child
        curve = self.curves.at(b)
        limit = curve.reach()
        if limit is not None:  # no further than the curve's reach into sizes never measured
            cands = cands[: max(limit - b, 0)]
        times = [1.0 if t is None else t for t in curve.table(b, b + len(cands))]
        proj = self.walk_time(b)
        # the walk projects one level of the batch per accepted depth: 1 + the longest expected walk
        best_n, best_rate, total, longest = 0, b / (draft_seconds + times[0] + proj), 0.0, 0.0
        plan.predicted_seconds = times[0] + proj
        walked: dict[int, float] = {}
        for n, c in enumerate(cands, 1):
            total += c[0]
            walked[c[3]] = walked.get(c[3], 0.0) + c[5]
            longest = max(longest, walked[c[3]])
            rate = (b + total) / (draft_seconds + times[n] + proj * (1 + longest))
            if rate > best_rate:
                best_n, best_rate = n, rate
                plan.predicted_seconds = times[n] + proj * (1 + longest)
        keep: dict[int, set[int]] = {st.rid: set() for st in plan.drafting}
        for *_, rid, i, _v in cands[:best_n]:
            keep[rid].add(i)
        for st in plan.drafting:  # a probe is measured on at least its best node
            if st.gate.probing and not keep[st.rid] and len(pool_of[st.rid]) > 1:
                i = max(range(1, len(pool_of[st.rid])), key=lambda j: (values[st.rid][j], -j))
                keep[st.rid] = _with_ancestors(pool_of[st.rid], i)
        plan.predicted = b + sum(values[rid][i] for rid, nodes in keep.items() for i in nodes)
        return [prune(pool_of[st.rid], keep[st.rid]) if st.rid in keep else Tree([st.root], [-1]) for st in live]

    def walk_time(self, batch: int) -> float:
        """Seconds of one level of the verification walk (the lm_head over the batch's nodes at that
        depth; 0 before measured, and where the target's forward projects every node itself)."""
        w = self.walk.get(grid_key(batch))
        return w[0] / w[1] if w and w[1] else 0.0

    def update(self, live: list[RequestState], plan: StepPlan, trees: list[Tree], emitted: list[list[int]],
               draft_seconds: float, forward_seconds: float, walk_seconds: float, step: int) -> None:
        """Learn from one verified step (``emitted``: per row, the accepted tokens and the bonus token):
        the curve (``forward_seconds``: the target's forward and the step's bookkeeping), the walk's cost
        per level (``walk_seconds``), the draft cost, acceptance and every drafting row's gate."""
        accepted = [len(e) - 1 for e in emitted]
        b = len(live)
        key = grid_key(b)
        q = sum(len(t) for t in trees)
        s = self.stats.setdefault(key, dict.fromkeys(STATS, 0.0))
        s["steps"] += 1
        self.curves.at(b).add(q, forward_seconds)
        w = self.walk.setdefault(key, [0.0, 0.0])
        w[0] = w[0] * self.walk_decay + walk_seconds
        w[1] = w[1] * self.walk_decay + 1 + max(accepted)
        if q == b:
            self.last_plain[key] = step
        if not plan.drafting:
            s["plain_steps"] += 1
            s["plain_s"] += draft_seconds + forward_seconds + walk_seconds
            return
        grow, r = plan.grow, len(plan.drafting)
        depth = max(grow.times) if grow is not None and grow.times else plan.spec.depth
        # a request's first draft also reads its prompt (the proposer catches up once): not a step's cost
        if all(st.gate.saved is not None for st in plan.drafting):
            for d, t in (grow.times.items() if grow is not None else ()):
                if d < depth:
                    self.draft.add(r, d, t)
            self.draft.add(r, depth, draft_seconds)
        drafted = q - b
        s["drafted"] += 1
        s["predicted"] += plan.predicted
        s["measured"] += b + sum(accepted)
        unscaled = (plan.predicted - b) / self.scale(b)  # what the values predicted before select scaled them
        bias = self.bias.setdefault(key, [0.0, 0.0])
        bias[0] = bias[0] * self.bias_decay + sum(accepted)
        bias[1] = bias[1] * self.bias_decay + unscaled
        s["tokens"] += q
        s["draft_s"] += draft_seconds
        s["verify_s"] += forward_seconds + walk_seconds
        s["predicted_verify_s"] += plan.predicted_seconds
        plain = self.verify_time(b, b) + self.walk_time(b)
        s["believed_plain_s"] += plain  # what drafting was weighed against
        beyond = max(forward_seconds + walk_seconds - plain, 0.0)
        modelled = self.draft.estimate(r, depth, plain)
        share = modelled / r  # a row's share of a step's draft, as modelled
        f, likely = self.scale(b), 0.0
        drafting = {st.rid for st in plan.drafting}
        for st, t, em, acc in zip(live, trees, emitted, accepted):
            if st.rid not in drafting:
                continue
            pool = plan.pools.get(st.rid, t)
            drawn = pool.draft_probs is not None and any(q is not None for q in pool.draft_probs[1:])
            self.acceptance.observe(st.rid, t if drawn else pool, em)  # sampled drafts: only those verified
            per_token = plan.weights.get(st.rid, 1.0) * plain / b  # the seconds one of its tokens saves the batch
            spent = share + (beyond * (len(t) - 1) / drafted if drafted else 0.0)
            expected = sum(self.acceptance.values(st.rid, t)[1:]) * f  # believed after this step
            likely += expected
            self._gate(st.gate, acc * per_token, spent, expected * per_token, step)
        if b == 1 or not self.curves.at(b).measured_at(q):  # a batch of one is its row's gate; no cold shapes
            return
        gate = self.gates.setdefault(key, RowGate())
        if plan.probe_of:  # judged as the step of all its rows that it stands for, and not in the means
            k = plan.probe_of / r
            spent = self.draft.estimate(plan.probe_of, depth, plain) + beyond * k
            if sum(accepted) * k * plain / b < spent and likely * k * plain / b < spent:
                self._shut(gate, step)
            else:
                gate.probing = False
        else:
            self._gate(gate, sum(accepted) * plain / b, modelled + beyond, likely * plain / b, step, keep=True)

    def _gate(self, g: RowGate, saved: float, spent: float, likely: float, step: int, keep: bool = False) -> None:
        """Weighs one drafted step (``likely``: the seconds the trees drafted are believed to save, after it).
        A probe starts a row's means afresh (its text has moved on); ``keep``: the means run on through
        probes (a batch size's costs do not change with its rows' texts), and only its mean paying ends its
        run of shut-offs: a step believed to pay keeps it drafting, but the wait after its next loss doubles
        on from the last."""
        first = g.saved is None or (g.probing and not keep)
        g.saved = saved if first else self.ema * saved + (1 - self.ema) * g.saved
        g.spent = spent if first else self.ema * spent + (1 - self.ema) * g.spent
        g.probing = False
        if g.saved < g.spent and likely < g.spent:
            self._shut(g, step)
        elif not keep or g.saved >= g.spent:
            g.wait = 0

    def _shut(self, g: RowGate, step: int) -> None:
        """The row decodes plainly for a wait that doubles on every shut-off in a row, then probes."""
        g.wait = min(max(2 * g.wait, self.min_wait), self.max_wait)
        g.open_at = step + 1 + g.wait
        g.probing = True

    def _likely_pays(self, st: RequestState, batch: int, weight: float, rows: int) -> bool:
        """Whether a chain drafted for a new request is expected to save more than its share of the step
        costs, by the acceptance the engine's requests so far have shown (the shared cells)."""
        plain = self.verify_time(batch, batch)
        per_token = weight * plain / batch
        f, reach, tokens = self.scale(batch), 1.0, 0.0
        for h in range(1, min(self.pool.depth, _room(st)) + 1):
            reach *= self.acceptance.reach(st.rid, h)
            tokens += reach
            verify = max(self.verify_time(batch + rows * h, batch) - plain, 0.0)
            if tokens * f * per_token >= (self.draft.estimate(rows, h, plain) + verify) / rows:
                return True
        return False

    def report(self) -> dict:
        """Per batch size: steps, drafted steps, mean tokens verified per row, the predicted against the
        measured tokens per drafted step, and the seconds of a drafted step (its draft, and its verify
        forward and walk against what the cost model predicted for the trees chosen) beside those of the
        plain steps the engine ran (drafting nothing) and what the cost model held a plain step to cost when
        it drafted; ``held_steps``: plain steps the batch's gate held (drafting lost at this batch size)."""
        out = {}
        for key, s in sorted(self.stats.items()):
            d, p = s["drafted"], s["plain_steps"]
            out[key] = {"steps": int(s["steps"]), "drafted": int(d),
                        "tree_tokens_per_step": s["tokens"] / d if d else 0.0,
                        "predicted_tokens_per_step": s["predicted"] / d if d else 0.0,
                        "measured_tokens_per_step": s["measured"] / d if d else 0.0,
                        "draft_seconds_per_step": s["draft_s"] / d if d else 0.0,
                        "verify_seconds_per_step": s["verify_s"] / d if d else 0.0,
                        "predicted_verify_seconds_per_step": s["predicted_verify_s"] / d if d else 0.0,
                        "believed_plain_seconds_per_step": s["believed_plain_s"] / d if d else 0.0,
                        "plain_steps": int(p), "plain_seconds_per_step": s["plain_s"] / p if p else 0.0,
                        "held_steps": int(s["held"])}
        return out


STATS = ("steps", "drafted", "predicted", "measured", "tokens", "draft_s", "verify_s", "predicted_verify_s",
         "believed_plain_s", "plain_steps", "plain_s", "held")


def worth(live: list[RequestState], spread: float, least: float) -> dict[int, float]:
    """What each row's tokens are worth this step, by request id (rows worth less than ``least`` of the
    last row's left out): a batch is done when its last row is, so tokens of a row sure to finish before
    the others save the batch little (the steps after it finishes are a row smaller), and those of the
    row furthest behind save the whole batch a step. Which row finishes last is uncertain by about the
    square root of the tokens to go (``spread`` times it): a row's worth falls by ``e`` for every such
    margin it is ahead of the row with the most to go. The worths sum to the batch size (all rows
    alike: 1 each)."""
    left = {st.rid: st.params.max_new_tokens - len(st.generated) for st in live}
    most = max(left.values())
    margin = spread * math.sqrt(max(most, 1))
    share = {rid: math.exp((n - most) / margin) for rid, n in left.items()}
    total = sum(share.values())
    return {rid: len(live) * u / total for rid, u in share.items() if u >= least}


def _room(st: RequestState) -> int:
    """How many drafted tokens a request can still take: those left to go but the bonus token."""
    return st.params.max_new_tokens - len(st.generated) - 1


def _with_ancestors(tree: Tree, node: int) -> set[int]:
    out = set()
    while node > 0:
        out.add(node)
        node = tree.parents[node]
    return out
