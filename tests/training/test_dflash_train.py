import math

import pytest
import torch
from _blocks import block_batch, with_draft_vocab

from draftheads.errors import DraftheadsError
from draftheads.heads import dflash as dflash_heads
from draftheads.targets import hidden_states
from draftheads.training.dflash import DFlashModule, dpace_weights, sample_anchors
from draftheads.training.losses import plain_linear_kl


@pytest.fixture(scope="module", params=[None, 20], ids=["full-vocab", "draft-vocab"])
def module(request, tiny_llama_dir):
    torch.manual_seed(0)
    m = DFlashModule(target=str(tiny_llama_dir), block_size=4, anchors_per_row=5, num_layers=2,
                     target_layer_ids=[1, 3], loss_impl="chunked")
    if request.param:
        with_draft_vocab(m, request.param, block_batch())
    m.configure_model()
    for p in m.head.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return m.train()


def test_anchors_lie_before_trained_tokens_of_the_same_document():
    b = block_batch()
    a = sample_anchors(b["loss_mask"], b["doc_ids"], 50, torch.Generator().manual_seed(0))
    for r in range(2):
        got = [x for x in a[r].tolist() if x >= 0]
        assert got == sorted(got) and len(got) == len(set(got))
        for x in got:
            assert b["loss_mask"][r, x + 1] == 1 and b["doc_ids"][r, x + 1] == b["doc_ids"][r, x]
    assert 13 not in a[1].tolist()  # its next token starts another document


def test_loss_equals_a_block_by_block_reference(module):
    batch = block_batch()
    loss, _, accs = module.compute_loss(batch)
    head, cfg = module.head, module.head.config
    n = module.info.num_layers
    gen = torch.Generator().manual_seed(module.hparams.seed * 1_000_003 + module.global_step)
    anchors = sample_anchors(batch["loss_mask"], batch["doc_ids"], module.hparams.anchors_per_row, gen)
    w = module.lm_head_weight
    ws, wt = w, w
    if cfg.draft_vocab_size:  # the head's own lm_head; the teacher over the same tokens
        draft = torch.arange(cfg.draft_vocab_size) + head.d2t
        ws, wt = head.lm_head.weight, w[draft]
        assert torch.equal(module.draft_ids(), draft)
    per_k = {k: ([], []) for k in range(1, cfg.block_size)}
    for r in range(2):  # each row and each block alone, with full logits
        ids, docs, pos = (batch[k][r: r + 1] for k in ("input_ids", "doc_ids", "position_ids"))
        for a in anchors[r].tolist():
            if a < 0:
                continue
            start = next(i for i in range(a + 1) if docs[0, i] == docs[0, a])  # the document's first token
            doc_ids = ids[:, start:]
            hs, _ = hidden_states(module.target, doc_ids, [1, 3, n])
            ctx = head.context(torch.cat([hs[1], hs[3]], -1)[:, : a - start])
            kv = head.context_kv(ctx, pos[:, start:a])
            block = head.block_inputs(module.embed(ids[:, [a]]))
            qpos = pos[:, a: a + 1] + torch.arange(cfg.block_size)
            out = head(block, qpos, kv, torch.ones(1, 1, cfg.block_size, a - start + cfg.block_size, dtype=torch.bool))
            for k in range(1, cfg.block_size):
                j = a + k
                if j >= ids.shape[1] or docs[0, j] != docs[0, a] or not batch["loss_mask"][r, j]:
                    continue
                per_k[k][0].append(out[0, k])
                per_k[k][1].append(hs[n][0, j - 1 - start])
    want = sum(math.exp(-(k - 1) / cfg.block_size) * plain_linear_kl(torch.stack(s), ws, torch.stack(t), wt)
               for k, (s, t) in per_k.items() if s)
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-5)
    assert len(accs) == cfg.block_size - 1


def _loss_and_grads(module, batch, attention):
    module.hparams.attention = attention
    try:
        module.head.zero_grad()
        loss, _, _ = module.compute_loss(batch)
        if torch.is_grad_enabled():
            loss.backward()
        return loss, [p.grad.clone() for p in module.head.parameters() if p.grad is not None]
    finally:
        module.hparams.attention = "tiles"


def test_tiles_of_one_block_give_the_dense_masks_loss_and_gradients(module, monkeypatch):
    batch = block_batch()
    want, want_grads = _loss_and_grads(module, batch, "sdpa")
    monkeypatch.setattr(dflash_heads, "TILE_ROWS", 1)  # one block per tile: 5 tiles per row
    got, grads = _loss_and_grads(module, batch, "tiles")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(grads) == len(want_grads) > 0
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_flex_attention_gives_the_dense_masks_loss_and_trains_on_cuda_only(module):
    batch = block_batch()
    with torch.no_grad():
        want, _ = _loss_and_grads(module, batch, "sdpa")
        got, _ = _loss_and_grads(module, batch, "flex")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(DraftheadsError, match="model.attention=flex trains on CUDA only"):
        _loss_and_grads(module, batch, "flex")  # with gradients, on CPU
    with pytest.raises(DraftheadsError, match="model.attention='dense': use one of"):
        DFlashModule(target="x", attention="dense")


def test_mask_token_must_not_be_a_real_token(tiny_llama_dir):
    m = DFlashModule(target=str(tiny_llama_dir), mask_token_id=5, block_size=4)
    from types import SimpleNamespace

    dm = SimpleNamespace(token_counts=lambda v, masked=False: torch.bincount(torch.tensor([5, 7]), minlength=v))
    with pytest.raises(DraftheadsError, match="occurs in the training data"):
        m._mask_token_id(SimpleNamespace(vocab_size=300), dm)
    m.hparams.mask_token_id = None
    assert m._mask_token_id(SimpleNamespace(vocab_size=300), dm) in (0, 1, 2)  # a special token, unused


def test_dpace_weights_by_hand():
    # one block of 3 drafts with confidences 0.6, 0.2, 1.0 and alpha 0.5: q~ = 0.8, 0.6, 1.0
    conf = torch.tensor([[0.6, 0.2, 1.0]])
    w = dpace_weights(conf, torch.ones(1, 3, dtype=torch.bool), 0.5)
    reach = [0.8, 0.8 * 0.6, 0.8 * 0.6 * 1.0]
    torch.testing.assert_close(w, torch.tensor([[sum(reach), reach[1] + reach[2], reach[2]]]))
    # an invalid middle position neither weighs nor interrupts the product
    w = dpace_weights(conf, torch.tensor([[True, False, True]]), 0.5)
    torch.testing.assert_close(w, torch.tensor([[0.8 + 0.8, 0.0, 0.8]]))


def test_dpace_loss_is_the_confidence_weighted_cross_entropy(module):
    """With position_weighting dpace, each draft's CE rows are weighted by dpace_weights of the draft's own
    confidences exp(-CE) (computed per block), instead of exp(-(k - 1) / B)."""
    batch = block_batch()
    hp = module.hparams
    hp.position_weighting, hp.loss = "dpace", "ce"
    try:
        loss, _, _ = module.compute_loss(batch)
        b = module.block_forward(batch)
        logits = b.out @ module.head.projection(module.lm_head_weight).T  # [B, N, blk, V or draft V]
        # the head's classes: a token outside a draft vocabulary has no CE term and confidence 0
        labels = module.in_head_vocab(batch["input_ids"].gather(1, b.pred.flatten(1)).view_as(b.pred))
        known = labels >= 0
        nll = torch.logsumexp(logits, -1) - logits.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        weights = dpace_weights(torch.where(known, torch.exp(-nll), 0.0), b.valid, hp.dpace_alpha)
        rows = b.valid & known
        want = sum((weights[:, :, k] * nll[:, :, k])[rows[:, :, k]].mean() for k in range(1, 4)
                   if rows[:, :, k].any())
        torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-5)
    finally:
        hp.position_weighting, hp.loss = "decay", "kl"
    with pytest.raises(DraftheadsError, match="set model.loss: ce"):
        DFlashModule(target="x", position_weighting="dpace")
