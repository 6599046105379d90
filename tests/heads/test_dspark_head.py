import pytest
import torch

from draftheads.errors import DraftheadsError
from draftheads.heads import load_head, save_head
from draftheads.heads.dspark import DSparkConfig, DSparkHead
from draftheads.heads.layers import LayerSpec

SPEC = LayerSpec(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _head(**kw) -> DSparkHead:
    torch.manual_seed(0)
    cfg = DSparkConfig(layer=SPEC, vocab_size=50, target_layer_ids=(1, 2), mask_token_id=49, block_size=3,
                       target_hidden_size=24, **{"markov_rank": 4, **kw})
    head = DSparkHead(cfg)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return head.eval()


@pytest.mark.parametrize("draft_vocab", [None, 20])
def test_markov_bias_folds_into_the_projection(draft_vocab):
    head = _head(draft_vocab_size=draft_vocab)
    lm = torch.randn(50, 32)
    h, prev = torch.randn(5, 32), torch.tensor([3, 0, 49, 7, 3])
    want = h @ head.projection(lm).T + head.markov_head.markov_w2(head.markov_head.markov_w1(prev))
    got = head.markov_inputs(h, prev) @ head.markov_projection(lm).T
    torch.testing.assert_close(got, want)
    w = head.confidence_head.proj
    conf = torch.cat([h, head.markov_head.markov_w1(prev)], -1) @ w.weight.T + w.bias
    torch.testing.assert_close(head.confidence_logit(h, prev), conf[:, 0])


def test_anchor_mode_drafts_every_slot():
    assert _head().config.drafts_per_block == 3 and _head().config.first_draft_slot == 0
    assert _head(sample_from_anchor=False).config.drafts_per_block == 2


def test_mask_slot_is_the_targets_row_and_not_saved(tmp_path):
    head = _head()
    emb = torch.randn(50, 32)
    head.use_target_mask(emb)
    block = head.block_inputs(torch.zeros(1, 1, 32))
    assert torch.equal(block[0, 1], emb[49]) and torch.equal(block[0, 2], emb[49])
    assert "mask_embedding" not in head.state_dict()
    save_head(head, tmp_path / "h")
    back, _ = load_head(tmp_path / "h")
    assert back.config == head.config and set(back.state_dict()) == set(head.state_dict())


def test_bad_configs_name_the_field():
    with pytest.raises(DraftheadsError, match="confidence_with_markov needs markov_rank"):
        _head(markov_rank=0)
    with pytest.raises(DraftheadsError, match="markov_rank=-1"):
        _head(markov_rank=-1, confidence_with_markov=False)
    with pytest.raises(DraftheadsError, match="no confidence head"):
        _head(confidence_head=False).confidence_logit(torch.zeros(1, 32), torch.tensor([0]))
