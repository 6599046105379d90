import pytest

from draftheads.inference.metrics import SpecMetrics
from draftheads.inference.timing import Run, interleaved, plausible, tokens_per_forward


def _metrics(emitted, forwards):
    m = SpecMetrics(emitted_tokens=emitted, target_forwards=forwards)
    return m


def test_rotating_order_and_ratios():
    calls = []

    def method(name, seconds):
        def run(item):
            calls.append((item, name))
            return Run(seconds, 10, _metrics(10, 4) if name == "spec" else None)
        return run

    t = interleaved({"plain": method("plain", 2.0), "spec": method("spec", 1.0)}, [0, 1, 2, 3])
    assert [n for i, n in calls if i == 0] == ["plain", "spec"] and [n for i, n in calls if i == 1] == ["spec", "plain"]
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
