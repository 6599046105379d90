"""DSpark drafting: sequential Markov sampling stays lossless, greedy chains follow the bias of each
drafted token, and the confidence head cuts a chain where its survival estimate falls."""

import torch
from _proposers import ToyLM, exact_first_three, tv_distance

from draftheads.inference.engine import Engine
from draftheads.inference.proposers.base import RequestState
from draftheads.inference.proposers.dflash import sample_chain
from draftheads.inference.proposers.dspark import DSparkProposer
from draftheads.inference.sampling import SamplingParams, target_probs
from draftheads.inference.tree import TreeSpec, parse_tree
from draftheads.inference.verify import verify_sampled
from draftheads.targets import hidden_states
from draftheads.testing import random_heads


def test_sequential_markov_sampling_keeps_the_target_distribution():
    """Each draft is drawn from q(. | the draft before it), as DSpark decodes a block; the rejection walk
    with those q gives the target's distribution over the first three tokens. (With the q of another
    previous token recorded instead, the same check measures TV 0.68; the sampling noise of 10k exact
    draws is about 0.02.)"""
    vocab, params = 8, SamplingParams(temperature=0.9, top_p=0.95)
    target = ToyLM(vocab, 1, 2.0, params)
    g = torch.Generator().manual_seed(5)
    base, bias = torch.randn(3, vocab, generator=g), torch.randn(vocab, vocab, generator=g) * 2
    gen = torch.Generator().manual_seed(11)
    n, counts = 10_000, {}
    for _ in range(n):
        out, root = [], 0
        while len(out) < 3:
            tree = sample_chain(root, 3, lambda d, prev: base[d] + bias[prev], params, gen)
            for node in range(1, len(tree)):  # q on each node is the Markov distribution given its parent
                want = target_probs(base[node - 1] + bias[tree.tokens[node - 1]], params)
                assert torch.equal(tree.draft_probs[node], want)
            out += verify_sampled(tree, target.table[tree.tokens], gen).tokens
            root = out[-1]
        counts[tuple(out[:3])] = counts.get(tuple(out[:3]), 0) + 1
    assert tv_distance(counts, exact_first_three(target, vocab), n) < 0.04


def _state(model, proposer, prompt, first):
    ids = torch.tensor([prompt])
    hs, _ = hidden_states(model, ids, list(proposer.layer_ids))
    st = RequestState(rid=0, prompt_len=len(prompt), tokens=[*prompt, first], params=SamplingParams(),
                      generator=torch.Generator())
    proposer.start(st, {i: h[0] for i, h in hs.items()})
    return st


def test_greedy_chain_follows_the_bias_of_each_drafted_token(tiny_target):
    model = tiny_target.model
    head = random_heads(model)["dspark"]
    proposer = DSparkProposer(head, model, min_survival=0.0)
    st = _state(model, proposer, [5, 9, 14, 3, 8, 2], 11)
    tree = proposer.propose(st, parse_tree("chain4"))
    out = proposer.block_hidden(st)
    lm = model.get_output_embeddings().weight
    prev, want = 11, []
    for d in range(4):
        logits = out[d] @ lm.T + head.markov_head.markov_w2(head.markov_head.markov_w1(torch.tensor(prev)))
        prev = int(logits.argmax())
        want.append(prev)
    assert tree.tokens == [11, *want] and tree.parents == [-1, 0, 1, 2, 3]
    no_bias = [int((out[d] @ lm.T).argmax()) for d in range(4)]
    assert no_bias != want  # the bias changes the drafts of this head, so the check above means something


def test_confidence_cuts_the_chain_where_survival_falls(tiny_target):
    model = tiny_target.model
    head = random_heads(model)["dspark"]
    with torch.no_grad():  # every draft estimated to survive with probability 0.5
        head.confidence_head.proj.weight.zero_()
        head.confidence_head.proj.bias.zero_()
    trees = []
    proposer = DSparkProposer(head, model, min_survival=0.2)  # 0.5, 0.25 kept; 0.125 cut
    propose = proposer.propose_batch
    proposer.propose_batch = lambda states, spec: trees.extend(propose(states, spec)) or trees[-len(states):]
    prompts = [[5, 9, 14, 3, 8, 2], [7, 7, 1, 30, 4]]
    params = SamplingParams(max_new_tokens=12, stop_at_eos=False)
    spec = Engine(model, proposer=proposer, tree="chain4").generate(prompts, params)
    plain = Engine(model).generate(prompts, params)
    assert trees and {len(t) for t in trees} == {3}
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    sampled = SamplingParams(max_new_tokens=12, stop_at_eos=False, temperature=1.0, seed=4)
    trees.clear()
    a = Engine(model, proposer=proposer, tree="chain4").generate(prompts, sampled)
    assert trees and {len(t) for t in trees} == {3} and all(t.draft_probs[1] is not None for t in trees)
    b = Engine(model, proposer=proposer, tree="chain4").generate(prompts, sampled)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]  # same seed, same output


def test_tree_children_are_expanded_with_their_parents_bias(tiny_target):
    model = tiny_target.model
    head = random_heads(model)["dspark"]
    proposer = DSparkProposer(head, model, min_survival=0.0)
    st = _state(model, proposer, [5, 9, 14, 3, 8, 2], 11)
    tree = proposer.propose(st, TreeSpec(depth=2, top_k=3, total_tokens=13))
    out = proposer.block_hidden(st)
    lm = model.get_output_embeddings().weight
    kids = tree.children()
    for node in kids[0]:  # each depth-1 node's children are the top of its own biased distribution
        bias = head.markov_head.markov_w2(head.markov_head.markov_w1(torch.tensor(tree.tokens[node])))
        top = torch.topk(out[1] @ lm.T + bias, 3).indices.tolist()
        assert [tree.tokens[c] for c in kids[node]] == top[: len(kids[node])]


def test_the_vllm_dspark_check_drafts_every_position_as_vllm_serves_it(tiny_target):
    """vLLM verifies all K drafts of a DSpark head unless adaptive verification is on: the check's proposer
    options (``EXPORTS['vllm-dspark'].proposer_options``) turn the confidence cut off, where our default keeps it."""
    from draftheads.export.vllm import EXPORTS
    from draftheads.inference.build import make_proposer
    from draftheads.inference.proposers.dspark import DEFAULT_MIN_SURVIVAL

    head = random_heads(tiny_target.model)["dspark"]
    assert make_proposer(tiny_target, head=head).min_survival == DEFAULT_MIN_SURVIVAL > 0
    assert make_proposer(tiny_target, head=head, options=EXPORTS["vllm-dspark"].proposer_options).min_survival == 0.0
