import pytest

from draftheads.inference.timing import Run, interleaved, median_ci, plausible, tokens_per_forward
from draftheads.metrics import SpecMetrics


def _metrics(emitted, forwards):
    m = SpecMetrics(emitted_tokens=emitted, target_forwards=forwards)
    return m


def test_shuffled_order_and_ratios():
    calls = []

    def method(name, seconds):
        def run(item):
            calls.append((item, name))
            return Run(seconds, 10, _metrics(10, 4) if name == "spec" else None)
        return run

    names = ["plain", "spec", "other"]
    t = interleaved({n: method(n, 2.0 if n != "spec" else 1.0) for n in names}, list(range(30)))
    orders = [tuple(n for i, n in calls if i == item) for item in range(30)]
    assert all(sorted(o) == sorted(names) for o in orders)  # each method once per item
    follows = {(o[k], o[k + 1]) for o in orders for k in range(2)}
    assert len(follows) == 6  # every method ran right after every other one (a rotation gives 3 pairs)
    r = t.ratio("spec")
    assert r["speedup"] == pytest.approx(2.0) and r["median"] == pytest.approx(2.0) and r["flagged"] == 0
    assert t.rate("spec") == pytest.approx(10.0)


def test_impossible_speedups_are_measured_again_then_flagged():
    runs = {"plain": 0, "spec": 0}

    def plain(item):
        runs["plain"] += 1
        return Run(1.0, 10)

    def spec(item):  # 10x faster than plain while emitting 1 token per forward: impossible
        runs["spec"] += 1
        return Run(0.1, 10, _metrics(10, 9))

    t = interleaved({"plain": plain, "spec": spec}, [0], retries=2)
    assert t.flagged == {"spec": [0]} and runs == {"plain": 3, "spec": 3}  # measured twice more, then flagged
    assert tokens_per_forward(_metrics(10, 9)) == pytest.approx(1.0)
    assert plausible(1.01, _metrics(10, 9)) and not plausible(1.5, _metrics(10, 9))
    assert plausible(2.5, _metrics(30, 9))  # 3 tokens per forward allow up to 3x


def test_median_ci_ranks_and_coverage():
    import random

    assert median_ci([float(i) for i in range(1, 101)]) == (40.0, 61.0)  # the textbook ranks for n = 100
    assert median_ci([3.0, 1.0, 2.0]) == (1.0, 3.0)  # too few values: the whole range
    rng = random.Random(0)
    trials, covered = 2000, 0
    for _ in range(trials):  # skewed noise; the true median of expovariate(1) is ln 2
        lo, hi = median_ci([rng.expovariate(1.0) for _ in range(25)])
        covered += lo <= 0.6931 <= hi
    assert 0.94 <= covered / trials <= 0.995


def test_noise_near_the_bound_is_kept_unbiased():
    """Runs of equal true cost with 5 % noise: a method at 1 token per forward sits right at its bound, so
    about half its pairs land above it. Keeping them (re-measuring only far-off items, all methods
    together) leaves both it and the A/A control centred on 1; re-measuring the pairs above the bound
    would censor that half and pull both ratios down."""
    import math
    import random

    rng = random.Random(1)
    calls = {"plain": 0, "plain (again)": 0, "spec": 0}

    def method(name):
        def run(item):
            calls[name] += 1
            return Run(math.exp(rng.gauss(0.0, 0.05)), 10, _metrics(10, 9))
        return run

    items = list(range(400))
    t = interleaved({n: method(n) for n in calls}, items)
    for n in ("plain (again)", "spec"):
        assert 0.985 <= t.ratio(n)["median"] <= 1.015
        assert t.ratio(n)["flagged"] == 0
    assert all(len(items) <= c <= len(items) + 4 for c in calls.values())  # items measured again: only 3-sigma ones
    assert not t.ratio("spec")["above_bound"]


def test_a_result_above_its_bound_is_marked():
    t = interleaved({"plain": lambda i: Run(1.1, 10), "spec": lambda i: Run(1.0, 10, _metrics(10, 9))}, [0, 1, 2])
    r = t.ratio("spec")
    assert r["speedup"] == pytest.approx(1.1) and r["above_bound"] and r["flagged"] == 0
