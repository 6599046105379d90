"""Trees cut by the ``auto`` policy keep the target's distribution at T > 0.

The policy chooses which drafted nodes to verify from the draft's scores and from what verification
accepted before, which is lossless only if no cut depends on the token a node drew from its q. Here each
proposer family's way of drafting (EAGLE's top-k tree, DFlash's per-position top-k over a block, DSpark's
chain drawn from q with the Markov dependence on the token before, n-gram's unscored chain) is played on
toy language models, every tree goes through :meth:`AutoPolicy.select` and the rejection walk, and the
policy learns from each outcome as it does in the engine. The first three tokens are compared with the
target's exact distribution over 10^5 draws per family."""

import math

import pytest
import torch
from _proposers import ToyLM, chi_square_sigmas, exact_first_three, tv_distance

from draftheads.inference.policy import AutoPolicy, StepPlan
from draftheads.inference.proposers.base import RequestState
from draftheads.inference.proposers.dflash import sample_chain
from draftheads.inference.sampling import SamplingParams
from draftheads.inference.tree import Tree, TreeSpec, chain_parents
from draftheads.inference.verify import verify_sampled

VOCAB = 10
DRAWS = 100_000
PARAMS = SamplingParams(temperature=0.9, top_p=0.95)


def _top_k_tree(root, dist_of, depth, k):
    """Top-k children of the ``k`` best nodes per depth; ``dist_of(depth, parent token)`` -> q [V]."""
    tokens, parents, scores = [root], [-1], [0.0]
    frontier = [0]
    for d in range(depth):
        cands = []
        for node in frontier:
            q = dist_of(d, tokens[node])
            top = torch.topk(q, k)
            for p, t in zip(top.values.tolist(), top.indices.tolist()):
                tokens.append(t)
                parents.append(node)
                scores.append(scores[node] + math.log(max(p, 1e-30)))
                cands.append(len(tokens) - 1)
        frontier = sorted(cands, key=lambda i: -scores[i])[:k]
    return Tree(tokens, parents, scores=scores)


def _drafter(family, draft: ToyLM, gen):
    if family == "eagle3":
        return lambda root: _top_k_tree(root, lambda d, prev: draft.probs(prev), 3, 2)
    if family == "dflash":  # each position's distribution is the block's, whatever the token before it
        return lambda root: _top_k_tree(root, lambda d, prev, r=root: draft.probs((r + d) % VOCAB), 3, 2)
    if family == "dspark":  # drawn left to right from q(. | the draft before), q kept for the walk
        return lambda root: sample_chain(root, 4, lambda d, prev: torch.log(draft.probs(prev) + 1e-30), PARAMS, gen)
    if family == "ngram":
        def chain(root):
            out = [root]
            for _ in range(4):
                out.append(draft.top[out[-1]][0])
            return Tree(out, chain_parents(4))
        return chain
    raise ValueError(family)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["eagle3", "dflash", "dspark", "ngram"])
def test_trees_cut_by_the_policy_keep_the_target_distribution(family):
    # a draft that ranks much as the target does (same logits, flatter), so most trees are worth cutting
    target, draft = ToyLM(VOCAB, 1, 2.0, PARAMS), ToyLM(VOCAB, 1, 1.2, PARAMS)
    gen = torch.Generator().manual_seed(99)
    propose = _drafter(family, draft, gen)
    pol = AutoPolicy(TreeSpec(depth=4, top_k=2, total_tokens=16))
    pol.curve.seed({1: 100, 2: 110, 4: 130, 8: 170, 16: 250})  # a token costs a tenth of a step
    st = RequestState(0, 1, [0], PARAMS, gen)
    pol.start(st)
    n, counts, step, sizes = DRAWS, {}, 0, []
    for _ in range(n):
        out, root = [], 0
        while len(out) < 3:
            step += 1
            st.tokens[-1] = root
            st.gate.open_at = 0  # every step drafts: the cut, not the gate, is under test
            plan = StepPlan([st], pol.pool)
            (tree,) = pol.select([st], plan, [propose(root)], 0.0)
            sizes.append(len(tree))
            res = verify_sampled(tree, target.table[tree.tokens], gen)
            pol.update([st], plan, [tree], [res.tokens], 0.0, 0.09 + 0.01 * len(tree), 0.0, step)
            out += res.tokens
            root = out[-1]
        counts[tuple(out[:3])] = counts.get(tuple(out[:3]), 0) + 1
    exact = exact_first_three(target, VOCAB)
    sigmas = chi_square_sigmas(counts, exact, n)
    print(f"{family}: chi-square {sigmas:+.2f} sigmas, TV {tv_distance(counts, exact, n):.4f}, {n} draws, "
          f"tree sizes {min(sizes)}-{max(sizes)} (mean {sum(sizes) / len(sizes):.2f})")
    assert sigmas < 5, (sigmas, tv_distance(counts, exact, n))
    # the policy drafted and cut: trees of several sizes, most of them beyond the root
    assert len(set(sizes)) > 2 and sum(sizes) / len(sizes) > 1.5, sorted(set(sizes))
