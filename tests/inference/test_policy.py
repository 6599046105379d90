import pytest
import torch

from draftheads.inference.engine import Engine, EngineConfig
from draftheads.inference.policy import AutoTree, CostCurve, RequestSwitch
from draftheads.inference.proposers.base import RequestState
from draftheads.inference.proposers.random_draft import RandomProposer
from draftheads.inference.sampling import SamplingParams
from draftheads.inference.tree import parse_tree
from draftheads.testing import OracleProposer, random_heads

TREES = {n: parse_tree(n) for n in ("chain2", "small", "large")}


def _drive(pol, tokens, steps, batch=1, seconds=None, first=1.0):
    """``tokens`` emitted and ``seconds`` (default 1) taken per step by each arm; an arm's first step takes
    ``first`` seconds instead (its kernels run cold)."""
    picks = []
    for _ in range(steps):
        arm = pol.choose(batch)
        cold = arm not in picks
        picks.append(arm)
        pol.update(arm, batch, tokens=int(tokens[arm]), seconds=first if cold else (seconds or {}).get(arm, 1.0),
                   query_tokens=1)
    return picks


def test_auto_tree_explores_then_exploits_and_probes_with_backoff():
    rates = {None: 10, "chain2": 14, "small": 12, "large": 11}  # tokens per step, all at one second a step
    pol = AutoTree(dict(TREES), explore_steps=2, probe_after=8, max_probe_after=64)
    picks = _drive(pol, rates, 400)
    assert picks[:6] == [None, None, "chain2", "chain2", "small", "small"]
    # small lost to chain2: the larger branching tree waits for small's probes, which keep losing
    assert "large" not in picks and pol.best(1) == "chain2"
    assert picks[8:].count("chain2") > 0.9 * len(picks[8:])  # 3 losing arms probed at most every 64 steps
    probes = [i for i, a in enumerate(picks) if i >= 8 and a != "chain2"]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes and max(gaps) > min(gaps)  # losing arms wait longer after each lost probe
    assert pol.cost_ratio("chain2", 1) == pytest.approx(1.0)


def test_a_cold_first_step_does_not_make_an_arm_look_slow():
    # plain's first step is 20x slower (new kernel shapes); it must still win against a chain that
    # emits 2 tokens per step at three times its cost
    pol = AutoTree({"chain2": TREES["chain2"]}, explore_steps=2, probe_after=100)
    picks = _drive(pol, {None: 1, "chain2": 2}, 60, seconds={None: 1.0, "chain2": 3.0}, first=20.0)
    assert pol.best(1) is None and pol.stats[1][None].step_time == 1.0
    assert picks[:4] == [None, None, "chain2", "chain2"] and set(picks[4:]) == {None}


def test_a_losing_tree_holds_back_the_larger_trees_of_its_kind_only():
    trees = {n: parse_tree(n) for n in ("chain1", "chain3", "small", "large")}
    tokens = {None: 10, "chain1": 5, "chain3": 6, "small": 4, "large": 3}
    pol = AutoTree(trees, explore_steps=2, probe_after=8, max_probe_after=64)
    picks = _drive(pol, tokens, 300)
    # chain1 lost: chain3 waits, but the branching trees are no chains: small is explored, then loses
    assert picks[:6] == [None, None, "chain1", "chain1", "small", "small"]
    assert "chain3" not in picks and "large" not in picks
    assert picks[6:].count("chain1") > 0 and picks[6:].count("small") > 0  # both probed, on their own backoff


def test_a_tree_losing_only_to_a_larger_one_of_its_kind_holds_nothing_back():
    # chain1 beats plain but loses to chain2: chain3 is explored (the largest explored chain below it,
    # chain2, is the best), and wins
    trees = {n: parse_tree(n) for n in ("chain1", "chain2", "chain3")}
    pol = AutoTree(trees, explore_steps=2, probe_after=8)
    picks = _drive(pol, {None: 10, "chain1": 12, "chain2": 16, "chain3": 19}, 60)
    assert picks[:8] == [None, None, "chain1", "chain1", "chain2", "chain2", "chain3", "chain3"]
    assert pol.best(1) == "chain3"


def test_a_costlier_probe_waits_longer():
    # both trees lose to plain; small's steps take 4 of plain's, chain1's 1: with the backoff capped at
    # 8 steps, small is probed about a quarter as often, so each takes the same share of the time
    trees = {n: parse_tree(n) for n in ("chain1", "small")}
    pol = AutoTree(trees, explore_steps=2, probe_after=8, max_probe_after=8)
    picks = _drive(pol, {None: 10, "chain1": 5, "small": 12}, 400, seconds={None: 1.0, "chain1": 1.0, "small": 4.0})
    probes = {a: picks[6:].count(a) for a in trees}
    assert 40 <= probes["chain1"] <= 50 and 9 <= probes["small"] <= 13, probes


def test_a_tree_is_judged_at_the_machines_speed_now():
    # chain2 emits 13 tokens a step where plain emits 10, at 1.4x plain's cost: it loses. After its
    # exploration the machine slows to 1.5x for every step; by its old times chain2 would now win
    trees = {"chain2": parse_tree("chain2")}
    pol = AutoTree(trees, explore_steps=3, probe_after=16)
    _drive(pol, {None: 10, "chain2": 13}, 40, seconds={None: 1.0, "chain2": 1.4})
    assert pol.best(1) is None
    slow = _drive(pol, {None: 10, "chain2": 13}, 200, seconds={None: 1.5, "chain2": 2.1})
    assert pol.best(1) is None and slow.count("chain2") <= 4, slow.count("chain2")
    assert pol.cost_ratio("chain2", 1) == pytest.approx(1.4)


def test_one_lucky_probe_does_not_make_a_losing_arm_the_best():
    # chain1 costs 1.5 plain steps and emits 1 token, but 2 on one probe long after its exploration (its
    # older steps decayed away): on its own that step would beat plain, and chain3 would be explored
    trees = {n: parse_tree(n) for n in ("chain1", "chain3")}
    for prior, flips in ((1.0, False), (0.0, True)):
        pol = AutoTree(trees, explore_steps=2, probe_after=40, prior_steps=prior)
        picks, chain1 = [], 0
        for _ in range(200):
            arm = pol.choose(1)
            chain1 += arm == "chain1"
            tokens = 2 if arm == "chain1" and chain1 == 3 else 1
            pol.update(arm, 1, tokens=tokens, seconds=1.5 if arm else 1.0, query_tokens=1)
            picks.append(arm)
        assert chain1 >= 3
        assert ("chain3" in picks) == flips, prior


def test_auto_tree_keeps_measurements_per_batch_size_and_skips_trees_that_cannot_pay():
    pol = AutoTree(dict(TREES), explore_steps=1)
    curve = CostCurve()
    curve.seed({1: 10.0, 16: 12.0, 64: 40.0, 1024: 800.0})
    pol.curve = curve
    assert pol.can_pay("large", 1) and not pol.can_pay("large", 16)  # 16 x 48 tokens: 7 x the cost at most
    picks = _drive(pol, {None: 10, "chain2": 9, "small": 9, "large": 9}, 10, batch=16)
    assert "large" not in picks, [(i, a) for i, a in enumerate(picks) if a]
    assert pol.stats[16][None].steps and 1 not in pol.stats


def test_an_arm_losing_at_one_batch_size_is_probed_not_explored_where_it_cannot_pay():
    trees = {n: parse_tree(n) for n in ("chain2", "small", "large")}
    per_row = {None: 1.0, "chain2": 1.0, "small": 2.0, "large": 2.0}  # tokens per row and step

    def run(tokens_per_row, batch, steps, pol):
        picks = []
        for _ in range(steps):
            arm = pol.choose(batch)
            q = batch * (trees[arm].total_tokens if arm else 1)
            pol.update(arm, batch, tokens=round(batch * tokens_per_row[arm]), seconds=pol.curve.at_least(q),
                       query_tokens=q)
            picks.append(arm)
        return picks

    def policy():
        pol = AutoTree(dict(trees), explore_steps=2, probe_after=30)
        pol.curve.seed({1: 1000, 4: 2000, 16: 2000, 64: 4000, 256: 9000})  # ms by query tokens
        return pol

    pol = policy()
    assert run(per_row, 1, 40, pol)[:6] == [None, None, "chain2", "chain2", "small", "small"]
    assert pol.best(1) is None and not pol.stats[1]["large"].steps  # small lost and held large back
    picks = run(per_row, 16, 40, pol)  # 48 and 192 query tokens: 3.3 s and 7.3 s against plain's 2 s
    # no exploration at batch 16, not even of large, which small held back at batch 1 and holds back here
    assert picks[:2] == [None, None] and picks[2:30] == [None] * 28
    assert "large" not in picks, [(i, a) for i, a in enumerate(picks) if a]
    assert {"chain2", "small"} <= set(picks[30:])  # probed once their first wait is over
    # what paid at batch 1 is explored at batch 16 as before
    pol = policy()
    run({None: 1.0, "chain2": 3.0, "small": 2.0, "large": 2.0}, 1, 40, pol)
    assert pol.best(1) == "chain2" and run(per_row, 16, 4, pol)[2:] == ["chain2", "chain2"]


def test_cost_curve_extrapolates_only_near_what_it_measured():
    curve = CostCurve()
    curve.add(1, 0.044)
    curve.add(2, 0.080)
    assert curve.estimate(2) == pytest.approx(0.080) and curve.estimate(4) == pytest.approx(0.152)
    assert curve.estimate(12) is None  # unknown: the tree is tried, not ruled out by a line through 1 and 2
    pol = AutoTree({"small": parse_tree("small")}, curve=curve)
    assert pol.can_pay("small", 1)


def test_request_switch_state_lives_on_the_request():
    sw = RequestSwitch(ema=0.0, off_steps=3)
    st = RequestState(0, 1, [1], SamplingParams(), None)
    sw.observe(st, tokens_emitted=1, step=1, cost_ratio=1.5)  # one token per step cannot pay 1.5x the cost
    assert not st.speculate and st.plain_until == 4
    sw.maybe_probe(st, step=2)
    assert not st.speculate
    sw.maybe_probe(st, step=4)
    assert st.speculate and st.spec_tau is None
    sw.observe(st, tokens_emitted=3, step=5, cost_ratio=1.5)
    assert st.speculate
    other = RequestState(0, 1, [1], SamplingParams(), None)  # the same row slot in the next call starts fresh
    assert other.speculate and other.spec_tau is None


class CostModelEngine(Engine):
    """The engine with each step's wall time replaced by a cost model (a fixed cost plus one per query
    token), so that the policy's decisions do not depend on the load of the machine running the tests."""

    def _credit(self, arm, live, trees, emitted, seconds, left):
        super()._credit(arm, live, trees, emitted, 1.0 + 0.1 * sum(len(t) for t in trees), left)


def _arms_run(engine):
    return {a: s.steps for b in engine.policy.stats.values() for a, s in b.items()}


def test_policy_goes_plain_on_a_useless_proposer(tiny_target):
    model = tiny_target.model
    engine = CostModelEngine(model, proposer=RandomProposer(model.config.vocab_size), tree="auto")
    params = SamplingParams(max_new_tokens=40, stop_at_eos=False)
    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11]]
    outs = [engine.generate(prompts, params) for _ in range(3)]  # the policy persists across calls
    plain = Engine(model).generate(prompts, params)
    assert all([o.token_ids for o in out] == [o.token_ids for o in plain] for out in outs)
    steps = _arms_run(engine)
    assert steps[None] > 0.85 * sum(steps.values())
    assert steps["large"] == 0  # pruned after the smaller trees lost


@pytest.mark.parametrize("prompts", [[[5, 6, 7, 8]], [[5, 6, 7, 8], [9, 10, 11]]])
def test_policy_speculates_with_an_oracle(tiny_target, prompts):
    model = tiny_target.model
    engine = CostModelEngine(model, proposer=OracleProposer(model, 4), tree="auto")
    params = SamplingParams(max_new_tokens=30, stop_at_eos=False)
    for _ in range(2):
        outs = engine.generate(prompts, params)
    plain = Engine(model).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    steps = _arms_run(engine)
    assert sum(v for a, v in steps.items() if a is not None) > 3 * steps[None]
    assert engine.policy.best(len(prompts)) is not None and all(o.metrics.tau > 2 for o in outs)


class _OneRowOracle(OracleProposer):
    """The target's own continuation for request 0, random tokens for the others."""

    name = "one-row-oracle"

    def __init__(self, model, depth):
        super().__init__(model, depth)
        self.random = RandomProposer(model.config.vocab_size)

    def propose(self, st, tree=None):
        return super().propose(st, tree) if st.rid == 0 else self.random.propose(st, parse_tree(f"chain{self.depth}"))


def test_a_batch_is_credited_with_what_its_last_row_advanced(tiny_target):
    # one row accepts every draft, the other none: the call still takes a step per token of the second
    # row, so speculating only adds verification work, however many tokens the first row emits
    model = tiny_target.model
    engine = CostModelEngine(model, proposer=_OneRowOracle(model, 4), tree="auto")
    params = SamplingParams(max_new_tokens=30, stop_at_eos=False)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    outs = [engine.generate(prompts, params) for _ in range(3)]
    plain = Engine(model).generate(prompts, params)
    assert all([o.token_ids for o in out] == [o.token_ids for o in plain] for out in outs)
    stats = engine.policy.stats[2]
    assert stats[None].steps > 0.85 * sum(s.steps for s in stats.values())
    # the drafted steps were credited with two tokens, one per row as a plain step, not the six the rows emit
    drafted = [s for a, s in stats.items() if a is not None and s.steps]
    assert drafted and all(s.tokens_per_step() == pytest.approx(2.0) for s in drafted)


class _AlwaysChain2(AutoTree):
    """Always speculates, and says a speculative step costs twice a plain one."""

    def choose(self, batch):
        return "chain2"

    def cost_ratio(self, arm, batch):
        return 2.0


def test_switch_statistics_do_not_leak_across_generate_calls(tiny_target):
    model = tiny_target.model
    policy = _AlwaysChain2({"chain2": parse_tree("chain2")})
    engine = Engine(model, proposer=RandomProposer(model.config.vocab_size), policy=policy)
    engine.switch = RequestSwitch(ema=0.0, off_steps=1000)
    params = SamplingParams(max_new_tokens=12, stop_at_eos=False)
    a = engine.generate([[5, 6, 7], [5, 6, 7]], params)
    b = engine.generate([[5, 6, 7], [5, 6, 7]], params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    # random drafts cannot pay twice the cost: the switch stops drafting after the first step, and a
    # new request in the same row slot starts drafting again
    assert [o.metrics.drafts for o in a + b] == [1, 1, 1, 1]
    # those switched-off steps are plain steps, and are credited so
    assert policy.stats[2][None].steps == a[0].metrics.target_forwards - 1 + b[0].metrics.target_forwards - 1


def test_a_lone_row_is_left_to_the_policy_arms(tiny_target):
    """At batch 1 the row is the batch: the policy's plain arm turns drafting off, not the switch."""
    model = tiny_target.model
    engine = Engine(model, proposer=RandomProposer(model.config.vocab_size),
                    policy=_AlwaysChain2({"chain2": parse_tree("chain2")}))
    engine.switch = RequestSwitch(ema=0.0, off_steps=1000)
    (out,) = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=12, stop_at_eos=False))
    assert out.metrics.drafts == out.metrics.target_forwards  # every step drafted


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

        def propose(live, t):
            if engine.steps in plain_steps:
                return orig(live, None)
            out = orig(live, t)
            drafts.append((len(live[0].tokens), out[0].tokens))  # keyed by the position in the text
            return out

        engine._propose = propose
        (o,) = engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_new_tokens=20, stop_at_eos=False))
        return o.token_ids, dict(drafts)

    full_tokens, full = run(set())
    gap_tokens, gapped = run({2, 3, 4, 5})
    assert gap_tokens == full_tokens
    after_gap = [n for n in gapped if n in full and n > min(gapped)]
    assert after_gap and all(gapped[n] == full[n] for n in gapped if n in full)


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
    from draftheads.inference.tree import Tree
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
