import pytest
import torch
import torch.nn.functional as F
from _blocks import block_batch, with_draft_vocab

from draftheads.errors import DraftheadsError
from draftheads.targets import hidden_states
from draftheads.training.dflash import position_weight, sample_anchors
from draftheads.training.dspark import DSparkModule, calibration_bins, expected_calibration_error


@pytest.fixture(scope="module", params=[(True, None), (False, None), (True, 20)],
                ids=["anchor", "fill-in", "anchor-draft-vocab"])
def module(request, tiny_llama_dir):
    torch.manual_seed(0)
    from_anchor, draft_vocab = request.param
    m = DSparkModule(target=str(tiny_llama_dir), block_size=4, anchors_per_row=5, num_layers=1,
                     target_layer_ids=[1, 3], markov_rank=8, sample_from_anchor=from_anchor, kl_weight=0.2)
    if draft_vocab:
        with_draft_vocab(m, draft_vocab, block_batch())
    m.configure_model()
    for p in m.head.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return m.train()


def test_loss_equals_a_block_by_block_reference(module):
    """Each block alone, full logits: 0.1 CE + 0.9 TV + 0.2 KL of q = softmax(h W^T + Markov bias of the
    data's previous token) against the target, plus the BCE of the confidence against sum_x min(p, q)."""
    batch = block_batch()
    loss, _, accs = module.compute_loss(batch)
    head, cfg = module.head, module.head.config
    n = module.info.num_layers
    gen = torch.Generator().manual_seed(module.hparams.seed * 1_000_003 + module.global_step)
    anchors = sample_anchors(batch["loss_mask"], batch["doc_ids"], module.hparams.anchors_per_row, gen)
    w = module.lm_head_weight
    ws, wt, label = w, w, lambda x: int(x)
    if cfg.draft_vocab_size:  # the head's own lm_head, the teacher over its tokens, CE only on them
        vocab = (torch.arange(cfg.draft_vocab_size) + head.d2t).tolist()
        ws, wt, label = head.lm_head.weight, w[vocab], lambda x: vocab.index(int(x)) if int(x) in vocab else None
    per_j = {}
    for r in range(2):
        ids, docs, pos = (batch[k][r: r + 1] for k in ("input_ids", "doc_ids", "position_ids"))
        for a in anchors[r].tolist():
            if a < 0:
                continue
            start = next(i for i in range(a + 1) if docs[0, i] == docs[0, a])
            hs, _ = hidden_states(module.target, ids[:, start:], [1, 3, n])
            kv = head.context_kv(head.context(torch.cat([hs[1], hs[3]], -1)[:, : a - start]), pos[:, start:a])
            block = head.block_inputs(module.embed(ids[:, [a]]))
            out = head(block, pos[:, a: a + 1] + torch.arange(cfg.block_size), kv,
                       torch.ones(1, 1, cfg.block_size, a - start + cfg.block_size, dtype=torch.bool))
            for k in range(cfg.first_draft_slot, cfg.block_size):
                j = k - cfg.first_draft_slot + 1  # draft index
                tgt = a + j  # the position it predicts
                if tgt >= ids.shape[1] or docs[0, tgt] != docs[0, a] or not batch["loss_mask"][r, tgt]:
                    continue
                prev = ids[0, tgt - 1]
                logits = out[0, k] @ ws.T + head.markov_head.markov_w2(head.markov_head.markov_w1(prev))
                log_q = torch.log_softmax(logits, -1)
                log_p = torch.log_softmax(hs[n][0, tgt - 1 - start] @ wt.T, -1)
                tv = 0.5 * (log_q.exp() - log_p.exp()).abs().sum()
                kl = (log_p.exp() * (log_p - log_q)).sum()
                c = label(ids[0, tgt])
                draft = (0.0 if c is None else 0.1 * -log_q[c]) + 0.9 * tv + 0.2 * kl
                conf = head.confidence_logit(out[0, k], prev)
                bce = F.binary_cross_entropy_with_logits(conf, (1 - tv).detach())
                per_j.setdefault(j, []).append((draft, bce))
    want = sum(position_weight(j, cfg.block_size) * (torch.stack([d for d, _ in v]).mean()
                                                      + torch.stack([b for _, b in v]).mean())
               for j, v in per_j.items())
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-5)
    assert len(accs) == cfg.drafts_per_block
    loss.backward()  # the Markov and confidence heads are trained
    assert head.markov_head.markov_w2.weight.grad.abs().sum() > 0
    assert head.confidence_head.proj.weight.grad.abs().sum() > 0
    module.zero_grad()


def test_expected_calibration_error_by_hand():
    conf = torch.tensor([0.05, 0.15, 0.12, 0.95])
    label = torch.tensor([0.0, 1.0, 0.0, 1.0])
    bins = calibration_bins(conf, label)
    assert bins[0].tolist() == [1, 2, 0, 0, 0, 0, 0, 0, 0, 1]
    # bin 0: |0.05 - 0|; bin 1: |0.27 - 1|; bin 9: |0.95 - 1|; over 4
    assert expected_calibration_error(bins) == pytest.approx((0.05 + 0.73 + 0.05) / 4)
    assert expected_calibration_error(bins + calibration_bins(conf, label)) == pytest.approx((0.05 + 0.73 + 0.05) / 4)


def test_bad_weights_name_the_field(tiny_llama_dir):
    with pytest.raises(DraftheadsError, match="model.confidence_label"):
        DSparkModule(target=str(tiny_llama_dir), confidence_label="sharp")
    with pytest.raises(DraftheadsError, match="model.tv_weight=-1"):
        DSparkModule(target=str(tiny_llama_dir), tv_weight=-1)
    with pytest.raises(DraftheadsError, match="all 0"):
        DSparkModule(target=str(tiny_llama_dir), ce_weight=0, tv_weight=0)


def test_validation_accumulates_the_confidence_calibration(module):
    module.eval()
    try:
        module.on_validation_epoch_start()
        with torch.no_grad():
            module.compute_loss(block_batch())
        bins = module._calibration
        cfg = module.head.config
        blocks = module.block_forward(block_batch())
        assert int(bins[0].sum()) == int(blocks.valid.sum())  # one calibration sample per trained draft
        assert 0 <= expected_calibration_error(bins) <= 1
    finally:
        module._calibration = None
        module.train()
    assert cfg.confidence_head
