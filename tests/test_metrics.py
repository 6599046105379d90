import math

import pytest

from draftheads.metrics import SpecMetrics, mean_ci95, simulated_tau, speedup


def test_tau_alpha_hand_counted():
    m = SpecMetrics()
    m.record_draft(3, 3)  # all accepted
    m.record_draft(3, 1)
    m.record_draft(3, 0)
    m.record_draft(2, 2)  # a shorter draft does not count at position 3
    assert m.drafts == 4 and m.accepted == 6 and m.draft_tokens == 11
    assert m.tau == pytest.approx(1 + 6 / 4)
    assert m.accepted_per_pos == [3, 2, 1]
    assert m.drafts_per_pos == [4, 4, 3]
    assert m.alpha == pytest.approx([3 / 4, 2 / 4, 1 / 3])
    assert m.acceptance_rate == pytest.approx(6 / 11)


def test_tree_draft_tokens_and_merge():
    a, b = SpecMetrics(), SpecMetrics()
    a.record_draft(4, 2, draft_tokens=20)
    b.record_draft(2, 1)
    b.emitted_tokens, b.wall_time_s = 10, 2.0
    m = a.merge(b)
    assert m.draft_tokens == 22 and m.drafts == 2 and m.accepted == 3
    assert m.accepted_per_pos == [2, 1, 0, 0] and m.drafts_per_pos == [2, 2, 1, 1]
    assert m.tokens_per_s == 5.0


def test_plain_decode_tau_is_one_and_bad_counts_rejected():
    assert SpecMetrics().tau == 1.0
    with pytest.raises(ValueError):
        SpecMetrics().record_draft(2, 3)


def test_simulated_tau_speedup_ci():
    assert simulated_tau([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert simulated_tau([]) == 1.0
    assert speedup(10.0, 4.0) == 2.5
    m, h = mean_ci95([1.0, 2.0, 3.0])
    assert m == 2.0 and h == pytest.approx(1.96 * 1 / math.sqrt(3))
