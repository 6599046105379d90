"""The three kinds of verification tests: exact greedy cases, same seed -> same output, and a
statistical test that sampled output follows the target distribution."""

import pytest
import torch
from _proposers import ToyLM, chi_square_sigmas, exact_first_three, tv_distance

from draftheads.inference.sampling import SamplingParams, target_probs
from draftheads.inference.tree import Tree
from draftheads.inference.verify import verify_greedy, verify_sampled

#        0 (root)
#      /   \
#     1:a   2:b
#    / \      \
#   3:c 4:d    5:e
TOKENS = [9, 1, 2, 3, 4, 5]
PARENTS = [-1, 0, 0, 1, 1, 2]


@pytest.mark.parametrize("argmax,accepted,tokens", [
    ([1, 4, 7, 7, 6, 7], [1, 4], [1, 4, 6]),   # root->a (1), a->d (4), bonus from d
    ([2, 0, 5, 7, 7, 8], [2, 5], [2, 5, 8]),   # second branch
    ([7, 4, 5, 0, 0, 0], [], [7]),             # nothing matches: bonus only
    ([1, 8, 0, 0, 0, 0], [1], [1, 8]),         # depth 1 then reject
])
def test_greedy_hand_made(argmax, accepted, tokens):
    res = verify_greedy(Tree(TOKENS, PARENTS), argmax)
    assert res.accepted == accepted and res.tokens == tokens and res.path == [0, *accepted]


def test_temperature_top_k_top_p_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    assert p[3] == 0 and torch.allclose(p[:3], torch.softmax(logits[:3], 0))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    full = torch.softmax(logits, 0)
    assert full[0] < 0.7 < full[0] + full[1]  # keeps exactly the first two
    assert torch.allclose(p, torch.tensor([full[0], full[1], 0, 0]) / (full[0] + full[1]))


# ------------------------------------------------------------------ statistical test


def _draft_tree(root, draft: ToyLM, depth, branching, sampled, gen):
    tokens, parents, qs = [root], [-1], [None]
    frontier = [0]
    for _ in range(depth):
        nxt = []
        for node in frontier:
            q = draft.probs(tokens[node])
            if sampled:
                kids = draft.sample(tokens[node], branching, gen)
            else:
                kids = draft.top[tokens[node]][:branching]
            for t in kids:
                tokens.append(t)
                parents.append(node)
                qs.append(q if sampled else None)
                nxt.append(len(tokens) - 1)
        frontier = nxt[:branching]  # keep the tree small: expand only the first `branching` nodes
    return Tree(tokens, parents, qs)


def _first_three(target, draft, depth, branching, sampled, gen, root=0):
    out = []
    while len(out) < 3:
        tree = _draft_tree(root, draft, depth, branching, sampled, gen)
        probs = target.table[tree.tokens]
        res = verify_sampled(tree, probs, gen)
        out += res.tokens
        root = out[-1]
    return tuple(out[:3])


@pytest.mark.parametrize("vocab,sampled,params", [
    (20, False, SamplingParams(temperature=1.0, top_k=6)),      # deterministic top-k drafts, branching 3, top-k
    (12, True, SamplingParams(temperature=0.8, top_p=0.9)),     # sampled drafts with known q, branching 2, top-p
])
def test_sampled_output_matches_target_distribution(vocab, sampled, params):
    target, draft = ToyLM(vocab, 1, 2.5, params), ToyLM(vocab, 2, 2.5, params)
    gen = torch.Generator().manual_seed(1234)
    n = 100_000
    counts: dict = {}
    for _ in range(n):
        key = _first_three(target, draft, depth=3, branching=2 if vocab < 20 else 3, sampled=sampled, gen=gen)
        counts[key] = counts.get(key, 0) + 1
    exact = exact_first_three(target, vocab)
    sigmas = chi_square_sigmas(counts, exact, n)
    assert sigmas < 5, (sigmas, tv_distance(counts, exact, n))


def test_same_seed_same_output():
    params = SamplingParams(temperature=1.0)
    runs = []
    for _ in range(2):
        target, draft = ToyLM(10, 3, 1.0, params), ToyLM(10, 4, 1.0, params)
        gen = torch.Generator().manual_seed(7)
        runs.append([_first_three(target, draft, 3, 2, True, gen) for _ in range(50)])
    target, draft = ToyLM(10, 3, 1.0, params), ToyLM(10, 4, 1.0, params)
    assert runs[0] == runs[1]
    gen = torch.Generator().manual_seed(8)
    assert [_first_three(target, draft, 3, 2, True, gen) for _ in range(50)] != runs[0]


# ------------------------------------------------------------------ the reference verifier (bench timing on one text)


def _reference_engine(model, tree="chain3"):
    from draftheads.inference.engine import Engine, EngineConfig
    from draftheads.inference.proposers.random_draft import RandomProposer

    return Engine(model, proposer=RandomProposer(model.config.vocab_size), tree=tree,
                  config=EngineConfig(verifier="reference"))


def test_reference_verifier_on_plain_text_is_plain_decoding(tiny_target):
    from draftheads.inference.engine import Engine

    model, prompt = tiny_target.model, [5, 6, 7]
    params = SamplingParams(max_new_tokens=40, stop_at_eos=False)
    (plain,) = Engine(model).generate([prompt], params)
    engine = _reference_engine(model)
    engine.verifier.texts = {tuple(prompt): plain.token_ids}
    (out,) = engine.generate([prompt], params)
    assert out.token_ids == plain.token_ids and engine.verifier.flips == 0


def test_reference_verifier_follows_another_text_and_counts_the_flips(tiny_target):
    from draftheads.inference.engine import Engine

    model, prompt = tiny_target.model, [5, 6, 7]
    params = SamplingParams(max_new_tokens=30, stop_at_eos=False)
    (plain,) = Engine(model).generate([prompt], params)
    text = list(plain.token_ids)
    text[10] = (text[10] + 1) % model.config.vocab_size  # one token the target would not choose
    engine = _reference_engine(model, tree="small")
    engine.verifier.texts = {tuple(prompt): text}
    (out,) = engine.generate([prompt], params)
    assert out.token_ids == text and engine.verifier.flips >= 1
    other = [8, 9]  # a prompt without a text decodes its own argmax
    (own,) = engine.generate([other], params)
    assert own.token_ids == Engine(model).generate([other], params)[0].token_ids


def test_reference_verifier_refuses_sampling(tiny_target):
    from draftheads.errors import DraftheadsError

    engine = _reference_engine(tiny_target.model)
    with pytest.raises(DraftheadsError, match="temperature 0"):
        engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, temperature=1.0))
