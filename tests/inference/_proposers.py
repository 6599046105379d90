"""Proposers for tests: random trees (the greedy oracle is draftheads.testing.OracleProposer);
a toy Markov language model and the exact distribution of its first three tokens for statistical tests."""

import itertools

import torch

from draftheads.inference.proposers.base import Proposer
from draftheads.inference.sampling import target_probs
from draftheads.inference.tree import Tree


class RandomTreeProposer(Proposer):
    name = "random"

    def check_tree(self, tree):
        pass  # drafts its own shape

    def __init__(self, vocab, size=9, seed=0):
        self.vocab, self.size = vocab, size
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, st, tree=None):
        parents = [-1] + [int(torch.randint(i, (1,), generator=self.gen)) for i in range(1, self.size)]
        tokens = [st.root] + torch.randint(self.vocab, (self.size - 1,), generator=self.gen).tolist()
        return Tree(tokens, parents)


class ToyLM:
    """A Markov chain over a small vocabulary: p(next | last token), under the sampling params."""

    def __init__(self, vocab, seed, sharpness, params):
        g = torch.Generator().manual_seed(seed)
        self.table = target_probs(torch.randn(vocab, vocab, generator=g) * sharpness, params)  # [V, V]
        self.top = torch.argsort(self.table, dim=-1, descending=True).tolist()
        self.pool: dict[int, list[int]] = {}

    def sample(self, token, k, gen):
        """k i.i.d. draws from p(. | token), served from a per-token pool drawn in bulk."""
        pool = self.pool.setdefault(token, [])
        if len(pool) < k:
            pool.extend(torch.multinomial(self.table[token], 4096, replacement=True, generator=gen).tolist())
        out = pool[-k:]
        del pool[-k:]
        return out

    def probs(self, token):
        return self.table[token]


def exact_first_three(target, vocab, root=0):
    t = target.table.tolist()
    return {(a, b, c): t[root][a] * t[a][b] * t[b][c] for a, b, c in itertools.product(range(vocab), repeat=3)}


def tv_distance(counts, exact, n):
    keys = set(counts) | set(exact)
    return 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in keys)


def chi_square_sigmas(counts, exact, n, min_expected=5.0):
    """How many standard deviations Pearson's chi-square statistic of ``counts`` (n draws) lies above its
    mean under the hypothesis that they were drawn from ``exact``: about N(0, 1) for an exact sampler,
    large for a biased one. Outcomes expected fewer than ``min_expected`` times are pooled into one bin;
    an outcome ``exact`` gives no probability is infinitely unlikely. (The total variation of n draws from
    the exact distribution itself is of order sqrt(outcomes / n), so a fixed TV bound either misses small
    biases or fails an exact sampler by chance.)"""
    if any(exact.get(k, 0.0) == 0 for k in counts):
        return float("inf")
    bins, pooled_obs, pooled_exp = [], 0, 0.0
    for k, p in exact.items():
        if n * p >= min_expected:
            bins.append((counts.get(k, 0), n * p))
        else:
            pooled_obs, pooled_exp = pooled_obs + counts.get(k, 0), pooled_exp + n * p
    if pooled_exp > 0:
        bins.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in bins)
    dof = len(bins) - 1
    return (stat - dof) / (2 * dof) ** 0.5
