import pytest

from draftheads.inference.engine import Engine
from draftheads.inference.metrics import SpecMetrics
from draftheads.inference.policy import AutoTree, RequestSwitch
from draftheads.inference.proposers.base import RequestState
from draftheads.inference.sampling import SamplingParams


def test_auto_tree_explores_then_exploits_the_fastest_arm():
    rates = {None: 10.0, "small": 14.0, "large": 12.0}  # tokens per second of each arm
    pol = AutoTree([None, "small", "large"], explore_steps=2, reexplore_every=1000)
    picks = []
    for _ in range(20):
        arm = pol.choose()
        picks.append(arm)
        pol.update(arm, tokens=int(rates[arm]), seconds=1.0)
    assert set(picks[:6]) == {None, "small", "large"}
    assert picks[6:] == ["small"] * 14 and pol.best() == "small"
    assert pol.cost_ratio("small") == pytest.approx(1.0)


def test_request_switch_turns_off_and_probes_again():
    sw = RequestSwitch(ema=0.0, off_steps=3)
    st = RequestState(0, 1, [1], SamplingParams(), None, SpecMetrics())
    sw.observe(st, tokens_emitted=1, step=1, cost_ratio=1.5)  # one token per step cannot pay 1.5x the cost
    assert not st.speculate
    sw.maybe_probe(st, step=2)
    assert not st.speculate
    sw.maybe_probe(st, step=4)
    assert st.speculate
    sw.observe(st, tokens_emitted=3, step=5, cost_ratio=1.5)
    assert st.speculate


def test_auto_tree_keeps_greedy_identity(tiny_target):
    from draftheads.inference.build import make_policy
    from draftheads.inference.proposers.ngram import NGramProposer

    model = tiny_target.model
    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11]]
    params = SamplingParams(max_new_tokens=30, stop_at_eos=False)
    proposer = NGramProposer(4)
    policy, switch = make_policy(proposer)
    auto = Engine(model, proposer=proposer, policy=policy, switch=switch).generate(prompts, params)
    plain = Engine(model).generate(prompts, params)
    assert [o.token_ids for o in auto] == [o.token_ids for o in plain]
    assert sum(s.steps for s in policy.stats.values()) > 0
