import pytest
import torch

from draftheads.datagen.batching import ContinuousBatcher, Conversation
from draftheads.errors import DraftheadsError
from draftheads.inference.engine import Engine
from draftheads.inference.sampling import SamplingParams
from draftheads.targets import hidden_states

PROMPTS = [[5, 6, 7, 8, 9], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37], [100, 101, 102], [40, 41, 42, 43]]


def _convs(params_of):
    return [Conversation(i, [p], params_of(i)) for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_refilled_batch_equals_one_by_one(tiny_target, temperature):
    """Rows of different lengths refilled from the queue give the tokens each prompt gets alone."""
    engine = Engine(tiny_target.model, tiny_target.tokenizer)
    lengths = [3, 17, 9, 12, 5]  # rows finish at different steps, so the batch of 2 is refilled

    def params(i):
        return SamplingParams(temperature=temperature, max_new_tokens=lengths[i], seed=100 + i, stop_at_eos=False)

    together = {f.key: f for f in ContinuousBatcher(engine, batch_size=2).run(_convs(params))}
    for i, p in enumerate(PROMPTS):
        (alone,) = engine.generate([p], params(i))
        assert together[i].answers == [alone.token_ids], i
        assert together[i].truncated == [True]
        assert len(together[i].answers[0]) == lengths[i]


def test_captured_features_equal_a_separate_forward(tiny_target):
    model = tiny_target.model
    engine = Engine(model, tiny_target.tokenizer)
    params = SamplingParams(max_new_tokens=11, stop_at_eos=False)
    batcher = ContinuousBatcher(engine, batch_size=3, capture=(1, 3, 4), feature_dtype=torch.float32)
    done = list(batcher.run([Conversation(i, [p], params) for i, p in enumerate(PROMPTS)]))
    assert sorted(f.key for f in done) == list(range(len(PROMPTS)))
    for f in done:
        ids = torch.tensor([f.token_ids])
        hs, logits = hidden_states(model, ids, [1, 3, 4], return_logits=True)
        assert len(f.token_ids) == len(PROMPTS[f.key]) + 11
        for i in (1, 3, 4):
            assert f.features[i].shape == (len(f.token_ids), model.config.hidden_size)
            torch.testing.assert_close(f.features[i], hs[i][0], atol=1e-4, rtol=1e-4)
        assert torch.equal(f.target_argmax, logits[0].argmax(-1))
        assert f.loss_mask == [0] * len(PROMPTS[f.key]) + [1] * 11


def test_end_of_turn_continues_with_the_next_segment(tiny_target):
    """With every token an end-of-turn id, each turn is one token and both segments are fed."""
    model = tiny_target.model
    engine = Engine(model, tiny_target.tokenizer, eos_token_ids=range(model.config.vocab_size))
    conv = Conversation("c", [[5, 6, 7], [9, 10, 11]], SamplingParams(max_new_tokens=6))
    (fin,) = ContinuousBatcher(engine, batch_size=1, capture=(4,), feature_dtype=torch.float32).run([conv])
    a, b = fin.answers
    assert len(a) == len(b) == 1 and fin.truncated == [False, False]
    assert fin.token_ids == [5, 6, 7, a[0], 9, 10, 11, b[0]]
    assert fin.loss_mask == [0, 0, 0, 1, 0, 0, 0, 1]
    hs, _ = hidden_states(model, torch.tensor([fin.token_ids]), [4])
    torch.testing.assert_close(fin.features[4], hs[4][0], atol=1e-4, rtol=1e-4)


def test_sequence_budget_truncates(tiny_target):
    engine = Engine(tiny_target.model, tiny_target.tokenizer)
    conv = Conversation("c", [[5, 6, 7, 8]], SamplingParams(max_new_tokens=100, stop_at_eos=False))
    (fin,) = ContinuousBatcher(engine, batch_size=1, max_seq_len=10).run([conv])
    assert len(fin.token_ids) == 10 and fin.truncated == [True]
    with pytest.raises(DraftheadsError, match="max sequence length"):
        list(ContinuousBatcher(engine, batch_size=1, max_seq_len=4).run([conv]))


def test_region_views_equal_gathered_attention(tiny_target, monkeypatch):
    """Rows in reserved contiguous regions are read as views; that must equal reading through slots."""
    from draftheads.inference.kv_cache import PagedKVCache

    engine = Engine(tiny_target.model, tiny_target.tokenizer)
    params = SamplingParams(max_new_tokens=9, stop_at_eos=False)

    def run():
        b = ContinuousBatcher(engine, batch_size=3, max_seq_len=40, capture=(2, 4), feature_dtype=torch.float32)
        return {f.key: f for f in b.run([Conversation(i, [p], params) for i, p in enumerate(PROMPTS)])}

    views = run()
    monkeypatch.setattr(PagedKVCache, "contiguous", lambda self, seq_id, n: None)
    gathered = run()
    for k, f in views.items():
        assert f.token_ids == gathered[k].token_ids
        torch.testing.assert_close(f.features[4], gathered[k].features[4], atol=1e-6, rtol=1e-6)


def test_reserved_regions_stay_contiguous():
    from draftheads.inference.kv_cache import PagedKVCache

    cache = PagedKVCache(1, 8, 1, 4, block_size=2)
    cache.add(0, range(4, 8))
    cache.reserve(0, 3)
    cache.truncate(0, 1)  # shorter than the region: its blocks stay
    assert cache.seqs[0].blocks == [4, 5, 6, 7] and cache.contiguous(0, 8) == (8, 16)
    assert cache.contiguous(0, 9) is None
    cache.add(1)
    cache.reserve(1, 8)
    assert sorted(cache.seqs[1].blocks) == [0, 1, 2, 3] and cache.contiguous(1, 2) is None
    cache.release(0)
    assert sorted(cache.free) == [4, 5, 6, 7]
