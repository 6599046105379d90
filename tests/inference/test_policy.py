import itertools
import math
import random

import pytest
import torch

from draftheads.inference.acceptance import AcceptanceModel
from draftheads.inference.cost import BatchCurves, CostCurve, DraftCost
from draftheads.inference.engine import Engine, EngineConfig
from draftheads.inference.policy import AutoPolicy, StepPlan, worth
from draftheads.inference.proposers.base import Proposer, RequestState
from draftheads.inference.proposers.random_draft import RandomProposer
from draftheads.inference.sampling import SamplingParams
from draftheads.inference.tree import Tree, TreeSpec, chain_parents, depths, parse_tree, prune
from draftheads.inference.verify import verify_greedy
from draftheads.testing import OracleProposer, random_heads


def _state(rid=0):
    return RequestState(rid, 1, [0], SamplingParams(), None)


# ----------------------------------------------------------------------------- the acceptance model


def _emitted(tokens, accepted, rng):
    """What the target emitted after a chain of ``tokens`` of which the first ``accepted`` were accepted."""
    return [*tokens[:accepted], 1000 + rng.randrange(1000)]


def test_acceptance_estimates_converge_to_a_drafters_known_rates():
    """A drafter whose node is accepted, once its parent is, with 0.5 x its confidence at depth 1 and
    0.25 x at depth 2 (over-confident, unlike the prior): the shared estimates converge to those rates,
    and a node is worth its parent's value times its own."""
    rng = random.Random(0)
    model = AcceptanceModel(shared_decay=0.9995)  # a window of about 2,000 steps: sampling noise ~0.02
    truth = {1: 0.5, 2: 0.25}
    for _ in range(4000):
        c1, c2 = rng.choice([0.35, 0.85]), rng.choice([0.35, 0.85])
        tree = Tree([0, 1, 2], chain_parents(2), scores=[0.0, math.log(c1), math.log(c1 * c2)])
        n = 0
        if rng.random() < truth[1] * c1:
            n = 2 if rng.random() < truth[2] * c2 else 1
        model.observe(None, tree, _emitted([1, 2], n, rng))
    for c in (0.35, 0.85):
        assert model.probability(None, 1, math.log(c)) == pytest.approx(truth[1] * c, abs=0.05)
        assert model.probability(None, 2, math.log(c)) == pytest.approx(truth[2] * c, abs=0.05)
    tree = Tree([0, 1, 2], chain_parents(2), scores=[0.0, math.log(0.85), math.log(0.85 * 0.35)])
    v = model.values(None, tree)
    assert v[2] == pytest.approx(v[1] * model.probability(None, 2, math.log(0.35)))


def test_nodes_left_out_of_the_verified_tree_are_labelled_by_what_the_target_emitted():
    """A pool of two siblings of which only the more confident one is ever verified: the other is right
    whenever the first is wrong, and the model learns that from the emitted tokens alone."""
    model = AcceptanceModel()
    pool = Tree([0, 1, 2, 3], [-1, 0, 0, 1], scores=[0.0, math.log(0.6), math.log(0.3), math.log(0.6 * 0.5)])
    rng = random.Random(0)
    for _ in range(300):
        emitted = [1, 3, 7] if rng.random() < 0.2 else [2, 9]  # the bonus after node 2 is never drafted
        model.observe(None, pool, emitted)
    assert model.probability(None, 1, math.log(0.6)) == pytest.approx(0.2, abs=0.06)
    assert model.probability(None, 1, math.log(0.3)) == pytest.approx(0.8, abs=0.06)
    assert model.probability(None, 2, math.log(0.5)) > 0.9  # node 3: right whenever its parent was
    assert model.reach(None, 1) > 0.95 and model.reach(None, 2) > 0.9


def test_a_requests_own_cells_move_it_away_from_the_shared_estimate():
    model = AcceptanceModel()
    model.start(7)
    tree = Tree([0, 1], [-1, 0], scores=[0.0, math.log(0.85)])
    for _ in range(30):
        model.observe(None, tree, [1, 5])  # other requests: always accepted
    for _ in range(15):
        model.observe(7, tree, [4])  # this one: never
    assert model.probability(7, 1, math.log(0.85)) < 0.3 < 0.6 < model.probability(None, 1, math.log(0.85))
    model.finish(7)
    assert model.probability(7, 1, math.log(0.85)) == model.probability(None, 1, math.log(0.85))


# ----------------------------------------------------------------------------- the cost model


def test_cost_curve_interpolates_is_optimistic_past_what_it_measured_and_follows_drift():
    c = CostCurve()
    assert c.optimistic(4) is None
    c.seed({1: 100, 8: 200})
    assert c.estimate(4) == pytest.approx(0.1 + 0.1 * 3 / 7)
    # past the largest size, a lower bound until measured: the slope between the two largest goes on
    assert c.estimate(16) is None and c.optimistic(16) == pytest.approx(0.2 + 0.1 / 7 * 8)
    for _ in range(200):  # the machine slows down 1.5x: the sizes not measured since follow
        c.add(1, 0.15)
    assert c.estimate(1) == pytest.approx(0.15, rel=0.02)
    assert 0.25 < c.estimate(8) < 0.31  # most of the slowdown is the machine's, not the curve's shape
    c.add(16, 9.0)  # the first forward of a size runs cold: not counted
    assert c.estimate(16) is None
    c.add(16, 0.4)
    assert 0.25 < c.estimate(16) < 0.4  # one measurement: taken optimistically until it is confirmed
    for _ in range(30):
        c.add(16, 0.4)
    assert c.estimate(16) == pytest.approx(0.4, rel=0.1)


def test_past_the_largest_size_a_curve_grows_by_its_least_slope_and_not_by_the_step_from_plain():
    """A tree's forward pays for its attention mask once: the step from plain decoding's size to the first
    tree is no per-token slope, and extrapolating it priced trees of two or three times the tokens measured
    far above what they cost, so they were never tried."""
    c = CostCurve(plain=1)
    c.seed({1: 100, 8: 200})
    assert c.optimistic(16) == pytest.approx(0.2)  # one tree size: flat past it until a larger one is measured
    c.seed({12: 220, 16: 260})
    assert c.optimistic(24) == pytest.approx(0.26 + 8 * 0.005)  # the least of 5 and 10 ms per token
    assert c.estimate(10) == pytest.approx(0.21)  # between sizes measured, interpolated as before
    curves = BatchCurves()
    assert curves.base.plain == 1 and curves.at(4).plain == 4 and curves.at(16).plain == 16


def test_a_batch_size_first_seen_borrows_the_nearest_curves_shape_and_measures_its_level():
    curves = BatchCurves()
    curves.base.seed({1: 100, 4: 110, 16: 150, 32: 200})
    c4 = curves.at(4)
    assert c4.optimistic(16) < 0.15  # borrowed points are held as two measurements: explored
    assert curves.at(3) is not c4 and curves.at(5) is not c4
    c16 = curves.at(16)  # nearest measured: batch 4's (the nearer by ratio, the larger on a tie)
    c16.add(16, 9.0)  # cold: not counted
    c16.add(16, 0.225)  # 1.5x what batch 1 took: the first measurement sets the level outright
    assert c16.estimate(32, optimistic=False) == pytest.approx(0.3)
    assert curves.base.estimate(32, optimistic=False) == pytest.approx(0.2)  # batch 1's own is untouched
    for _ in range(5):
        c16.add(16, 0.3)  # later ones move it by less
    assert 0.3 < c16.estimate(32, optimistic=False) < 0.4
    # what a curve measured itself, against what it borrowed
    assert (curves.base.measured_at(16), c16.measured_at(16), c16.measured_at(32), c4.measured_at(4)) == (20, 6, 0, 0)


def test_rows_behind_are_worth_more_in_a_batch_that_ends_with_its_last_row():
    rows = [RequestState(rid, 1, [0], SamplingParams(max_new_tokens=64), None) for rid in range(4)]
    assert worth(rows, 1.5, 0.1) == {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}  # all alike
    rows[0].tokens += [7] * 10
    rows[1].tokens += [7] * 40
    w = worth(rows, 1.5, 0.1)
    assert 1 not in w  # 40 tokens ahead of the last: it finishes first whatever is drafted
    assert 0.0 < w[0] < 1.0 < w[2] == w[3]
    assert sum(w.values()) <= 4.0

    def ahead_by_4(done: int) -> float:  # the worth of a row 4 tokens ahead of three others
        rows = [RequestState(rid, 1, [0] * (1 + done + 4 * (rid == 0)), SamplingParams(max_new_tokens=64), None)
                for rid in range(4)]
        return worth(rows, 1.5, 0.1)[0]

    assert ahead_by_4(52) < ahead_by_4(0) < 1.0  # nearer the end, the last row is the more certain


def test_draft_cost_extrapolates_from_the_depths_it_measured():
    d = DraftCost()
    assert d.estimate(1, 3, verify=1.0) == pytest.approx(0.15 * 1.5)  # before any measurement
    d.add(1, 1, 9.0)  # the first draft at each depth runs cold: not counted
    d.add(1, 1, 0.10)
    d.add(1, 3, 9.0)
    d.add(1, 3, 0.30)
    assert d.estimate(1, 5) == pytest.approx(0.50)
    assert d.estimate(4, 1, verify=1.0) == pytest.approx(0.15)  # another batch size has its own


# ----------------------------------------------------------------------------- the choice of nodes


def _closed_subsets(tree):
    nodes = range(1, len(tree))
    for r in range(len(tree)):
        for sub in itertools.combinations(nodes, r):
            if all(tree.parents[i] == 0 or tree.parents[i] in sub for i in sub):
                yield set(sub)


@pytest.mark.parametrize("seed", range(6))
def test_the_chosen_trees_are_the_brute_force_optimum(seed):
    """Over every tree closed under ancestors in two rows' pools, the policy's choice has the best expected
    tokens per second by its own models."""
    rng = random.Random(seed)
    pol = AutoPolicy(TreeSpec(depth=3, top_k=2, total_tokens=8))
    slope = rng.choice([0.01, 0.05, 0.2])
    pol.curve.seed({n: 1000 * (1 + slope * (n - 1)) for n in (1, 2, 4, 8, 16)})
    rows = [_state(0), _state(1)]
    for st in rows:
        pol.start(st)
    pools = []
    for _ in rows:
        parents = [-1, 0, 0, 1, 1, 3]
        s = [0.0]
        for i in range(1, len(parents)):
            s.append(s[parents[i]] + math.log(rng.uniform(0.05, 0.95)))
        pools.append(Tree(list(range(len(parents))), parents, scores=s))
    draft = rng.choice([0.0, 0.1, 0.5])
    worths = rng.choice([{}, {0: 1.6, 1: 0.4}])  # a batch with a row behind: its tokens count for more
    plan = StepPlan(rows, pol.pool, weights=worths)
    for st in rows:
        st.gate.probing = False
    chosen = pol.select(rows, plan, pools, draft)
    values = [pol.acceptance.values(st.rid, t) for st, t in zip(rows, pools)]

    def rate(subs):
        n = sum(len(s) for s in subs)
        got = sum(worths.get(st.rid, 1.0) * v[i] for st, v, s in zip(rows, values, subs) for i in s)
        return (2 + got) / (draft + pol.verify_time(2 + n, 2))

    best = max(rate(pair) for pair in itertools.product(*(list(_closed_subsets(t)) for t in pools)))
    got = [set(range(1, len(t))) for t in chosen]  # the chosen trees as node sets of the pools
    kept = []
    for t, pool in zip(chosen, pools):
        idx = [pool.scores.index(x) for x in t.scores[1:]]
        kept.append(set(idx))
        assert prune(pool, idx).tokens == t.tokens
    assert len(got) == 2 and rate(kept) == pytest.approx(best)


def test_values_that_run_high_are_scaled_to_what_the_chosen_trees_accept(monkeypatch):
    """An acceptance model that values every node of a chain at twice its chance of being accepted (the
    chance 0.5 x 0.9 ** depth; its value 0.9 ** depth): the policy scales the values it chooses by to what
    its trees accept, so its predictions come to match the outcome and it verifies fewer nodes."""
    pol = AutoPolicy(TreeSpec(depth=4, top_k=1, total_tokens=5), bias_decay=0.995)
    pol.curve.seed({n: 1000 * (1 + 0.35 * (n - 1)) for n in (1, 2, 4, 8)})
    monkeypatch.setattr(pol.acceptance, "values", lambda rid, t: [0.9 ** d for d in depths(t.parents)])
    monkeypatch.setattr(pol.acceptance, "observe", lambda *a: None)
    st = _state()
    pol.start(st)
    pool = Tree([0, 1, 2, 3, 4], chain_parents(4), scores=[0.0, -0.1, -0.2, -0.3, -0.4])
    rng = random.Random(0)
    sizes = []
    for step in range(600):
        plan = StepPlan([st], pol.pool)
        st.gate.probing = False
        (tree,) = pol.select([st], plan, [pool], 0.0)
        sizes.append(len(tree))
        accepted = 0
        if len(tree) > 1 and rng.random() < 0.45:  # depth 1 with 0.5 x 0.9, each further depth with 0.9
            accepted = 1
            while accepted < len(tree) - 1 and rng.random() < 0.9:
                accepted += 1
        pol.update([st], plan, [tree], [[*tree.tokens[1:1 + accepted], 99]], 0.0, 1.0, 0.0, step)
    assert pol.scale(1) == pytest.approx(0.5, abs=0.1)
    plan = StepPlan([st], pol.pool)
    (tree,) = pol.select([st], plan, [pool], 0.0)
    expected = sum(0.5 * 0.9 ** d for d in range(1, len(tree)))  # what the chosen chain accepts on average
    assert plan.predicted - 1 == pytest.approx(expected, rel=0.2)
    assert 1 < len(tree) < sizes[0] == 5


# ----------------------------------------------------------------------------- in the engine


class ModelledPolicy(AutoPolicy):
    """The policy with every measured time replaced by a cost model (a verify forward costs 1 + 0.05 per
    query token beyond one, a draft depth 0.1), so its decisions do not depend on the machine's load."""

    def select(self, live, plan, pools, draft_seconds):
        return super().select(live, plan, pools, self._draft(plan))

    def update(self, live, plan, trees, emitted, draft_seconds, forward_seconds, walk_seconds, step):
        q = sum(len(t) for t in trees)
        if plan.grow is not None:
            plan.grow.times = {d: 0.1 * d for d in plan.grow.times}
        super().update(live, plan, trees, emitted, self._draft(plan), 1 + 0.05 * (q - 1), 0.0, step)

    @staticmethod
    def _draft(plan):
        if not plan.drafting:
            return 0.0
        return 0.1 * (max(plan.grow.times) if plan.grow is not None and plan.grow.times else plan.spec.depth)


def _modelled(proposer):
    return ModelledPolicy.for_proposer(proposer)


def test_auto_keeps_to_plain_decoding_on_a_useless_drafter(tiny_target):
    model = tiny_target.model
    proposer = RandomProposer(model.config.vocab_size)
    proposer.auto_pool = TreeSpec(depth=4, top_k=2, total_tokens=12)
    engine = Engine(model, proposer=proposer, policy=_modelled(proposer))
    params = SamplingParams(max_new_tokens=60, stop_at_eos=False)
    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11]]
    outs = [engine.generate(prompts, params) for _ in range(3)]
    plain = Engine(model).generate(prompts, params)
    assert all([o.token_ids for o in out] == [o.token_ids for o in plain] for out in outs)
    drafted = sum(o.metrics.drafts for out in outs for o in out)
    steps = sum(o.metrics.target_forwards for out in outs for o in out)
    assert drafted < 0.2 * steps  # probes only, each wait doubling up to max_wait
    report = engine.policy.report()[2]
    # every step is either drafted or plain, and each kind's seconds are kept apart
    assert report["plain_steps"] + report["drafted"] == report["steps"] and report["plain_steps"] > report["drafted"]
    assert report["plain_seconds_per_step"] > 0 and report["verify_seconds_per_step"] > 0


@pytest.mark.parametrize("prompts", [[[5, 6, 7, 8]], [[5, 6, 7, 8], [9, 10, 11]]])
def test_auto_drafts_deep_with_a_drafter_that_is_always_right(tiny_target, prompts):
    model = tiny_target.model
    proposer = OracleProposer(model, 6)
    proposer.auto_pool = TreeSpec(depth=6, top_k=1, total_tokens=7)
    engine = Engine(model, proposer=proposer, policy=_modelled(proposer))
    params = SamplingParams(max_new_tokens=40, stop_at_eos=False)
    for _ in range(2):
        outs = engine.generate(prompts, params)
    plain = Engine(model).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(o.metrics.tau > 4 and o.metrics.drafts > 0.8 * o.metrics.target_forwards for o in outs)
    report = engine.policy.report()[len(prompts)]
    # no scores: one confidence bin per depth, learnt from the prior (0.3 ** depth) to be always accepted
    assert all(engine.policy.acceptance.probability(None, d, None) > 0.85 for d in range(1, 7))
    assert 0.7 * report["measured_tokens_per_step"] < report["predicted_tokens_per_step"]
    assert report["draft_seconds_per_step"] > 0 and report["predicted_verify_seconds_per_step"] > 0
    assert report["believed_plain_seconds_per_step"] > 0


def test_each_batch_size_measures_its_own_plain_step_before_it_drafts(tiny_target):
    """A batch size first seen borrows another's curve, whose plain point is a tree of as many tokens over
    fewer rows: drafting at the new size waits until a plain forward of it is measured (its first one cold)."""
    model = tiny_target.model
    proposer = OracleProposer(model, 4)
    proposer.auto_pool = TreeSpec(depth=4, top_k=1, total_tokens=5)
    engine = Engine(model, proposer=proposer, policy=_modelled(proposer))
    params = SamplingParams(max_new_tokens=24, stop_at_eos=False)
    engine.generate([[5, 6, 7, 8]], params)
    outs = engine.generate([[5, 6, 7, 8], [9, 10, 11], [4, 3], [8, 8, 9]], params)
    report, curve = engine.policy.report(), engine.policy.curves.at(4)
    assert report[1]["plain_steps"] == 2 and report[4]["plain_steps"] == 2  # one cold, one counted, at each size
    assert curve.measured_at(4) == 1 and report[4]["drafted"] > 0
    assert all(o.metrics.drafts == o.metrics.target_forwards - 2 for o in outs)  # drafting from the third step


def test_a_draft_that_goes_depth_by_depth_narrows_as_more_rows_draft():
    """Each depth of such a draft is a forward over rows x width tokens: under auto the width shrinks so
    that the rows drafting together read about what one row does at full width."""
    from draftheads.inference.proposers.dflash import DFlashProposer
    from draftheads.inference.proposers.draft_tree import DraftTreeProposer

    assert DraftTreeProposer.width_by_rows and not DFlashProposer.width_by_rows  # a block is one forward
    spec = TreeSpec(depth=6, top_k=4, total_tokens=64)
    for narrow, widths in ((True, [4, 2, 1, 1]), (False, [4, 4, 4, 4])):
        pol = AutoPolicy(spec, narrow=narrow)
        pol.curve.seed({1: 100, 4: 110})
        for n in (2, 3, 4):  # a plain step measured at each batch size
            pol.curves.at(n).seed({n: 100, 4 * n: 110})
        rows = [_state(i) for i in range(4)]
        for st in rows:
            pol.start(st)
        plans = [pol.plan(rows[:n], n) for n in (1, 2, 3, 4)]
        assert [p.spec.top_k for p in plans] == [p.grow.top_k for p in plans] == widths
        assert all(len(p.drafting) == n for p, n in zip(plans, (1, 2, 3, 4)))


class _TurnsGood(Proposer):
    """Drafts a chain of 4 with the same confidence throughout: random tokens before the request has
    ``switch`` tokens, the target's own continuation after (acceptance 0, then about 0.8: the oracle's
    token is replaced by a random one at a depth with probability 0.2)."""

    name = "turns-good"
    auto_pool = TreeSpec(depth=4, top_k=1, total_tokens=5)

    def __init__(self, model, switch):
        self.oracle, self.switch = OracleProposer(model, 4), switch
        self.vocab = model.config.vocab_size
        self.gen = torch.Generator().manual_seed(0)

    def check_tree(self, tree):
        pass

    def propose(self, st, tree):
        if len(st.tokens) < self.switch:
            tokens = torch.randint(self.vocab, (4,), generator=self.gen).tolist()
        else:
            tokens = self.oracle.propose(st).tokens[1:]
            tokens = [t if torch.rand((), generator=self.gen) < 0.8 else (t + 1) % self.vocab for t in tokens]
        return Tree([st.root, *tokens], chain_parents(4), scores=[math.log(0.7) * d for d in range(5)])


def _drafted_at(pol):
    """Spies on ``pol.select``: the lengths of row 0's text at each step it verified a drafted node."""
    at, select = [], pol.select

    def spy(live, plan, pools, draft_seconds):
        trees = select(live, plan, pools, draft_seconds)
        if len(trees[0]) > 1:
            at.append(len(live[0].tokens))
        return trees

    pol.select = spy
    return at


def test_a_request_whose_drafts_turn_good_drafts_again_within_a_bounded_wait(tiny_target):
    model = tiny_target.model
    prompt = [5, 6, 7, 8]
    switch = len(prompt) + 80
    proposer = _TurnsGood(model, switch)
    pol = _modelled(proposer)
    engine = Engine(model, proposer=proposer, policy=pol)
    drafted_at = _drafted_at(pol)
    (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=200, stop_at_eos=False))
    before = [n for n in drafted_at if n < switch]
    after = [n for n in drafted_at if n >= switch]
    assert len(before) < 20  # 80 tokens of rejections: probes, further and further apart
    # the first probe after the switch comes within the longest wait (plus the probe step itself)
    assert after and after[0] - switch <= pol.max_wait + 1
    # and from then on it drafts: most tokens come from accepted drafts
    assert len(after) > 0.5 * (len(out.token_ids) + len(prompt) - after[0]) / 4


def test_a_batch_where_drafting_loses_decodes_plainly_and_drafts_again_within_a_bounded_wait(tiny_target):
    """At batch 4 the batch's own gate weighs each drafted step as a whole: while every row's drafts are
    rejected it holds the batch to plain steps (probes further and further apart, each by one of its rows),
    and once they turn good the batch drafts again within the longest wait, its rows' waits having run
    meanwhile."""
    model = tiny_target.model
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12], [4, 3, 2, 1], [8, 8, 9, 9]]
    switch = len(prompts[0]) + 80
    proposer = _TurnsGood(model, switch)
    pol = _modelled(proposer)
    pol.probe_least = 1  # a quarter of 4 rows probes a shut batch
    engine = Engine(model, proposer=proposer, policy=pol)
    drafted_at = _drafted_at(pol)
    plans, plan = [], pol.plan
    pol.plan = lambda live, step: plans.append(plan(live, step)) or plans[-1]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=200, stop_at_eos=False))
    probes = [p for p in plans if p.probe_of]
    assert probes and all(len(p.drafting) == 1 and 2 <= p.probe_of <= 4 for p in probes)
    report = pol.report()[4]
    assert report["held_steps"] > 10 and report["held_steps"] <= report["plain_steps"]
    before = [n for n in drafted_at if n < switch]
    after = [n for n in drafted_at if n >= switch]
    assert len(before) < 20
    assert after and after[0] - switch <= pol.max_wait + 1
    assert len(after) > 0.5 * (len(outs[0].token_ids) + len(prompts[0]) - after[0]) / 4
    gate = pol.gates[4]
    assert gate.wait == 0 and gate.saved > gate.spent  # drafting pays at the end: the gate is open


def test_a_batch_gate_is_forgiven_only_by_its_mean_paying():
    """A batch size whose drafted steps lose on the mean probes further and further apart even where a step
    was believed to pay, which keeps it drafting; a row's gate, whose text moves on, starts its waits over
    on such a step. A mean that pays opens the batch's gate for good."""
    from draftheads.inference.policy import RowGate

    pol = AutoPolicy(TreeSpec(depth=4, top_k=2, total_tokens=8))
    batch, row = RowGate(), RowGate()
    for g, keep in ((batch, True), (row, False)):
        pol._gate(g, saved=1.0, spent=2.0, likely=0.5, step=10, keep=keep)  # loses, not believed to pay
        assert g.wait == pol.min_wait and g.open_at == 10 + 1 + pol.min_wait
        pol._gate(g, saved=1.0, spent=2.0, likely=3.0, step=20, keep=keep)  # loses, believed to pay
        assert g.open_at <= 20
        pol._gate(g, saved=1.0, spent=2.0, likely=0.5, step=30, keep=keep)  # loses again
    assert batch.wait == 2 * pol.min_wait and row.wait == pol.min_wait
    for step in range(40, 80):
        pol._gate(batch, saved=4.0, spent=1.0, likely=0.0, step=step, keep=True)
    assert batch.saved > batch.spent and batch.wait == 0


def test_a_new_request_drafts_at_once_where_drafting_paid(tiny_target):
    model = tiny_target.model
    proposer = OracleProposer(model, 4)
    proposer.auto_pool = TreeSpec(depth=4, top_k=1, total_tokens=5)
    pol = _modelled(proposer)
    engine = Engine(model, proposer=proposer, policy=pol)
    params = SamplingParams(max_new_tokens=30, stop_at_eos=False)
    engine.generate([[5, 6, 7]], params)
    at = _drafted_at(pol)
    engine.generate([[9, 10, 11]], params)
    assert at[0] == 4  # its first step drafts: the prompt and the token the prefill emitted


def test_a_new_request_waits_where_drafting_did_not_pay_and_still_finds_a_good_draft(tiny_target):
    """A drafter that paid nothing on the requests before does not cost a new request a probe at once
    (its first draft reads the whole prompt); it waits as long as the last request last waited, then
    probes, so a prompt on which the drafter is good is found within the longest wait."""
    model = tiny_target.model
    bad = _TurnsGood(model, switch=10**6)  # random tokens throughout
    pol = _modelled(bad)
    engine = Engine(model, proposer=bad, policy=pol)
    engine.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=120, stop_at_eos=False))
    assert pol.last_wait > 1
    engine.proposer = good = _TurnsGood(model, switch=0)  # the same policy and acceptance cells
    good.gen.manual_seed(1)
    at = _drafted_at(pol)
    prompt = [9, 10, 11]
    (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=120, stop_at_eos=False))
    first = at[0] - len(prompt)  # tokens emitted before its first draft: one per plain step
    assert 1 < first <= pol.max_wait + 2
    assert len(at) > 0.5 * (len(out.token_ids) - first) / 4  # from then on it drafts


def test_catch_up_after_plain_steps_gives_the_same_drafts(tiny_target):
    """Drafting after a plain stretch (one draft forward over the missed tokens) proposes what a drafter
    that followed every step proposes."""
    from draftheads.inference.proposers.eagle3 import Eagle3Proposer

    model = tiny_target.model
    head = random_heads(model)["eagle3"]
    tree = parse_tree("small")

    def run(plain_steps):
        proposer = Eagle3Proposer(head, model)
        engine = Engine(model, proposer=proposer, tree=tree)
        drafts = []
        orig = engine._propose

        def propose(live):
            if engine.steps in plain_steps:
                return None, [Tree([st.root], [-1]) for st in live]
            plan, out = orig(live)
            drafts.append((len(live[0].tokens), out[0].tokens))  # keyed by the position in the text
            return plan, out

        engine._propose = propose
        (o,) = engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_new_tokens=20, stop_at_eos=False))
        return o.token_ids, dict(drafts)

    full_tokens, full = run(set())
    gap_tokens, gapped = run({2, 3, 4, 5})
    assert gap_tokens == full_tokens
    after_gap = [n for n in gapped if n in full and n > min(gapped)]
    assert after_gap and all(gapped[n] == full[n] for n in gapped if n in full)


@pytest.mark.parametrize("family", ["eagle3", "dflash", "dspark", "medusa"])
def test_auto_is_greedy_identical_for_every_family_and_sizes_its_trees(tiny_target, family):
    from draftheads.inference.build import make_proposer

    model = tiny_target.model
    heads = random_heads(model)
    if family not in heads:
        pytest.skip(f"no random {family} head")
    proposer = make_proposer(tiny_target, head=heads[family])
    engine = Engine(model, proposer=proposer, policy=_modelled(proposer))
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22]]
    params = SamplingParams(max_new_tokens=24, stop_at_eos=False)
    outs = engine.generate(prompts, params)
    plain = Engine(model).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    report = engine.policy.report()[2]
    assert report["drafted"] > 0 and report["tree_tokens_per_step"] <= 2 * proposer.auto_pool.total_tokens


def test_lazy_and_full_lm_head_give_identical_greedy_output(tiny_target):
    from draftheads.inference.proposers.eagle3 import Eagle3Proposer

    model = tiny_target.model
    head = random_heads(model)["eagle3"]
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22]]
    params = SamplingParams(max_new_tokens=16, stop_at_eos=False)
    outs = {}
    for lazy in (True, False):
        engine = Engine(model, proposer=Eagle3Proposer(head, model), tree="medium",
                        config=EngineConfig(lazy_lm_head=lazy))
        outs[lazy] = engine.generate(prompts, params)
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    assert [o.metrics.accepted for o in outs[True]] == [o.metrics.accepted for o in outs[False]]


def test_lazy_lm_head_projects_only_the_walked_nodes(tiny_target):
    from draftheads.inference.verify import ExactVerifier, NodeLogits

    model = tiny_target.model
    w = model.get_output_embeddings().weight
    hidden = torch.randn(6, w.shape[1])
    logits = NodeLogits(hidden, w)
    full = hidden @ w.T
    am = full.argmax(-1).tolist()
    tree = Tree([0, am[0], 1, 2, 3, 4], [-1, 0, 0, 1, 1, 2])  # node 1 is the target's choice
    st = RequestState(0, 1, [0], SamplingParams(), None)
    (res,) = ExactVerifier().verify([st], [tree], logits)
    assert res.tokens[0] == am[0] and res.accepted[:1] == [1]
    assert logits.projected == 1 + len(res.accepted)  # the root, then one node per accepted depth


@pytest.mark.parametrize("seed", range(4))
def test_the_walk_that_projects_ahead_accepts_what_the_one_depth_walk_does(seed):
    """Random trees whose target follows the draft's likeliest child most of the time: every look-ahead
    gives the same walk, and one that covers the whole tree projects once per depth the draft missed."""
    from draftheads.inference.verify import NodeLogits, _greedy_walk

    gen = torch.Generator().manual_seed(seed)
    vocab, hidden = 6, 8
    trees, offs, off = [], [], 0
    for size in (1, 5, 9, 14):
        parents = [-1] + [int(torch.randint(i, (1,), generator=gen)) for i in range(1, size)]
        scores = [0.0] + torch.rand(size - 1, generator=gen).log().tolist()
        trees.append(Tree(torch.randint(vocab, (size,), generator=gen).tolist(), parents, scores=scores))
        offs.append(off)
        off += size
    h, w = torch.randn(off, hidden, generator=gen), torch.randn(vocab, hidden, generator=gen)
    calls = {}
    for ahead in (0, 1, 3, 16):
        logits = NodeLogits(h, w)
        rows = logits.rows
        calls[ahead] = 0

        def counted(idx, rows=rows, ahead=ahead):
            calls[ahead] += 1
            return rows(idx)

        logits.rows = counted
        got = _greedy_walk(trees, logits, offs, ahead)
        want = [verify_greedy(t, (h[o: o + len(t)] @ w.T).argmax(-1).tolist()) for t, o in zip(trees, offs)]
        assert [(r.accepted, r.tokens) for r in got] == [(r.accepted, r.tokens) for r in want]
    assert calls[16] <= calls[3] <= calls[1] <= calls[0] == 1 + max(len(r.accepted) for r in want)
    missed = []
    for t, r in zip(trees, want):
        kids, path = t.children(), [0, *r.accepted]
        missed.append(sum(b != max(kids[a], key=lambda c: t.scores[c]) for a, b in zip(path, path[1:])))
    assert calls[16] == 1 + max(missed)


def test_synthetic_verifier_accepts_by_rate(tiny_target):
    model = tiny_target.model
    cfg = EngineConfig(verifier="synthetic", synthetic_rates=(1.0, 1.0, 0.0))
    engine = Engine(model, proposer=RandomProposer(model.config.vocab_size), tree="chain3", config=cfg)
    (out,) = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=30, stop_at_eos=False))
    assert out.metrics.alpha == [1.0, 1.0, 0.0] and out.metrics.tau == pytest.approx(3.0)
    cfg = EngineConfig(verifier="synthetic", synthetic_rates=(0.5,))
    engine = Engine(model, proposer=RandomProposer(model.config.vocab_size), tree="chain1", config=cfg)
    (out,) = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=300, stop_at_eos=False))
    assert 0.4 < out.metrics.alpha[0] < 0.6


def test_prune_keeps_a_subtree_with_its_scores():
    t = Tree([9, 1, 2, 3, 4], [-1, 0, 0, 1, 3], scores=[0.0, -0.1, -0.2, -0.3, -0.4])
    p = prune(t, {1, 3})
    assert (p.tokens, p.parents, p.scores) == ([9, 1, 3], [-1, 0, 1], [0.0, -0.1, -0.3])
    assert depths(p.parents) == [0, 1, 2]
    with pytest.raises(ValueError, match="without its parent"):
        prune(t, {4})


def test_cost_table_is_the_optimistic_estimate_at_every_size():
    c = CostCurve()
    assert c.table(1, 3) == [None] * 3
    c.seed({2: 100, 8: 200, 16: 260})
    c.drift = 1.3
    assert c.table(1, 40) == pytest.approx([c.optimistic(q) for q in range(1, 41)])


def test_a_size_measured_slow_once_is_not_ruled_out_for_good():
    c = CostCurve()
    c.seed({1: 40, 16: 60})
    for t in (0.0, 0.09):  # the first forward of a size is cold and dropped; then one slow step
        c.add(10, t)
    assert c.estimate(10) <= c.estimate(16)  # no dearer than the larger size measured
    for _ in range(40):
        c.add(10, 0.05)
    assert c.estimate(10) == pytest.approx(0.05, rel=0.1)
