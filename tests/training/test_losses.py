import pytest
import torch

from draftheads.heads.medusa import MedusaConfig, MedusaHeads
from draftheads.training.losses import (
    IGNORE_INDEX,
    eagle3_loss,
    future_mask,
    linear_block_distill,
    linear_cross_entropy,
    linear_kl,
    linear_kl_to,
    linear_token_nll,
    medusa_loss,
    plain_linear_block_distill,
    plain_linear_cross_entropy,
    plain_linear_kl,
    shift_left,
)


def _grads(fn, *tensors):
    tensors = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
    loss = fn(*tensors)
    loss.backward()
    return loss.detach(), [t.grad for t in tensors if t.requires_grad]


def _close(a, b, rel=1e-5):
    err = (a - b).abs().max().item()
    scale = b.abs().max().item() + 1e-12
    assert err <= rel * scale, f"max abs err {err:.3e} vs scale {scale:.3e}; first bad index " \
        f"{((a - b).abs() > rel * scale).nonzero()[:5].tolist()}"


@pytest.mark.parametrize("frozen_w", [False, True])
@pytest.mark.parametrize("n,h,v,chunk", [(37, 16, 101, 8), (5, 32, 1000, 1024)])
def test_linear_ce_matches_plain(n, h, v, chunk, frozen_w):
    torch.manual_seed(0)
    x = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, h, dtype=torch.float64, requires_grad=not frozen_w)
    labels = torch.randint(0, v, (n,))
    labels[::4] = IGNORE_INDEX
    fused = _grads(lambda a, b: linear_cross_entropy(a, b, labels, chunk_size=chunk, impl="chunked"), x, w)
    plain = _grads(lambda a, b: plain_linear_cross_entropy(a, b, labels), x, w)
    _close(fused[0], plain[0])
    assert len(fused[1]) == len(plain[1]) == (1 if frozen_w else 2)
    for a, b in zip(fused[1], plain[1]):
        _close(a, b)


@pytest.mark.parametrize("frozen_w", [False, True])
def test_linear_kl_matches_plain_fp32(frozen_w):
    torch.manual_seed(1)
    hs = torch.randn(29, 24, requires_grad=True)
    ws = torch.randn(77, 24, requires_grad=not frozen_w)
    ht, wt = torch.randn(29, 20), torch.randn(77, 20)
    fused = _grads(lambda a, b: linear_kl(a, b, ht, wt, chunk_size=7, impl="chunked"), hs, ws)
    plain = _grads(lambda a, b: plain_linear_kl(a, b, ht, wt), hs, ws)
    _close(fused[0], plain[0])
    for a, b in zip(fused[1], plain[1]):
        _close(a, b)


@pytest.mark.parametrize("grad", [True, False])
def test_linear_kl_returns_the_students_argmax_with_the_same_loss(grad):
    torch.manual_seed(3)
    hs, ws = torch.randn(29, 24, requires_grad=grad), torch.randn(77, 24, requires_grad=grad)
    ht, wt = torch.randn(29, 20), torch.randn(77, 20)
    loss, top = linear_kl(hs, ws, ht, wt, chunk_size=7, impl="chunked", return_argmax=True)
    assert torch.equal(top, (hs @ ws.T).argmax(-1))
    _close(loss, plain_linear_kl(hs, ws, ht, wt))
    assert loss.requires_grad == grad


@pytest.mark.parametrize("cache_bytes", [1 << 30, 0])  # teacher log-probs computed once, or per step
def test_eagle3_loss_equals_its_sum_of_per_step_kls(monkeypatch, cache_bytes):
    import draftheads.training.losses as losses

    monkeypatch.setattr(losses, "TEACHER_CACHE_BYTES", cache_bytes)
    torch.manual_seed(5)
    b, t, h, ht_dim, v, steps = 2, 13, 8, 6, 17, 3
    outs = [torch.randn(b, t, h, requires_grad=True) for _ in range(steps)]
    features, ws, wt = torch.randn(b, t, ht_dim), torch.randn(v, h, requires_grad=True), torch.randn(v, ht_dim)
    loss_mask = torch.ones(b, t, dtype=torch.long)
    loss_mask[:, :3] = 0  # a prompt
    doc_ids = torch.zeros(b, t, dtype=torch.long)
    doc_ids[1, 7:] = 1  # two documents in the second row
    want = torch.randint(0, v, (b, t))
    want[0, 5] = want[1, 9] = -1  # outside the draft vocabulary
    total, per_step, accs = eagle3_loss(outs, features, loss_mask, doc_ids, ws, wt, want, decay=0.5, chunk_size=4,
                                        impl="chunked")
    total.backward()
    ref = torch.zeros(())
    for j, out in enumerate(outs):
        # by hand: step j at position p predicts the target's distribution at p + 1 + j, in one document
        rows = [(r, p) for r in range(b) for p in range(t - 2 - j)
                if loss_mask[r, p + 2 + j] and doc_ids[r, p] == doc_ids[r, p + 2 + j] and want[r, p + 1 + j] >= 0]
        hs = torch.stack([out[r, p] for r, p in rows])
        kl = plain_linear_kl(hs, ws, torch.stack([features[r, p + 1 + j] for r, p in rows]), wt)
        _close(per_step[j], kl.detach())
        ref = ref + 0.5**j * kl
        scored = sum(int(loss_mask[r, p + 2 + j] and doc_ids[r, p] == doc_ids[r, p + 2 + j])
                     for r in range(b) for p in range(t - 2 - j))
        hits = sum(int((out[r, p] @ ws.T).argmax() == want[r, p + 1 + j]) for r, p in rows)
        assert accs[j] == pytest.approx(hits / scored)
    _close(total.detach(), ref.detach())
    grads = [o.grad.clone() for o in outs] + [ws.grad.clone()]
    for x in outs + [ws]:
        x.grad = None
    ref.backward()
    for a, x in zip(grads, outs + [ws]):
        _close(a, x.grad)


@pytest.mark.parametrize("weights", [(0.1, 0.9, 0.0), (0.0, 1.0, 0.0), (0.3, 0.2, 0.5)])
@pytest.mark.parametrize("frozen_w", [False, True])
def test_linear_block_distill_matches_plain(weights, frozen_w):
    """CE + TV + KL in one chunked pass: loss, gradients, acceptance sum_x min(p, q) and argmax."""
    torch.manual_seed(2)
    hs = torch.randn(31, 12, dtype=torch.float64, requires_grad=True)
    ws = torch.randn(53, 12, dtype=torch.float64, requires_grad=not frozen_w)
    ht, wt = torch.randn(31, 10, dtype=torch.float64), torch.randn(53, 10, dtype=torch.float64)
    labels = torch.randint(0, 53, (31,))
    labels[::5] = IGNORE_INDEX
    got = linear_block_distill(hs, ws, ht, wt, labels, *weights, chunk_size=6)
    want = plain_linear_block_distill(hs, ws, ht, wt, labels, *weights)
    _close(got[1].double(), want[1].double())
    assert torch.equal(got[2], want[2])
    fused = _grads(lambda a, b: linear_block_distill(a, b, ht, wt, labels, *weights, chunk_size=6)[0], hs, ws)
    plain = _grads(lambda a, b: plain_linear_block_distill(a, b, ht, wt, labels, *weights)[0], hs, ws)
    _close(fused[0], plain[0])
    for a, b in zip(fused[1], plain[1]):
        _close(a, b, rel=1e-5)
    with torch.no_grad():  # the validation path: same loss without the gradient work
        _close(linear_block_distill(hs, ws, ht, wt, labels, *weights, chunk_size=6)[0], plain[0])


@pytest.mark.parametrize("frozen_w", [False, True])
def test_linear_block_distill_low_rank_bias_equals_the_concatenated_projection(frozen_w):
    """hs @ ws.T + e @ we.T as a second pair: the same loss and gradients as cat([hs, e]) @ cat([ws, we]).T,
    and a frozen ws gets no gradient work."""
    torch.manual_seed(3)
    hs = torch.randn(17, 12, dtype=torch.float64, requires_grad=True)
    ws = torch.randn(41, 12, dtype=torch.float64, requires_grad=not frozen_w)
    e = torch.randn(17, 3, dtype=torch.float64, requires_grad=True)
    we = torch.randn(41, 3, dtype=torch.float64, requires_grad=True)
    ht, wt = torch.randn(17, 10, dtype=torch.float64), torch.randn(41, 10, dtype=torch.float64)
    labels = torch.randint(0, 41, (17,))
    fused = _grads(lambda a, b, c, d: linear_block_distill(a, b, ht, wt, labels, 0.2, 0.8, 0.1, chunk_size=5,
                                                           bias_in=c, bias_w=d)[0], hs, ws, e, we)
    cat = _grads(lambda a, b, c, d: plain_linear_block_distill(torch.cat([a, c], 1), torch.cat([b, d], 1), ht, wt,
                                                               labels, 0.2, 0.8, 0.1)[0], hs, ws, e, we)
    _close(fused[0], cat[0])
    assert len(fused[1]) == len(cat[1]) == (3 if frozen_w else 4)
    for a, b in zip(fused[1], cat[1]):
        _close(a, b)


def test_row_weighted_cross_entropy_and_token_nll_match_plain():
    torch.manual_seed(4)
    x = torch.randn(23, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(70, 16, dtype=torch.float64)
    labels = torch.randint(0, 70, (23,))
    labels[::6] = IGNORE_INDEX
    rw = torch.rand(23, dtype=torch.float64) * 3
    fused = _grads(lambda a: linear_cross_entropy(a, w, labels, chunk_size=5, impl="chunked", row_weights=rw), x)
    keep = labels != IGNORE_INDEX
    nll = torch.nn.functional.cross_entropy(x @ w.T, labels.clamp(min=0), reduction="none")
    plain = _grads(lambda a: (torch.nn.functional.cross_entropy(a @ w.T, labels.clamp(min=0), reduction="none")
                              * rw * keep).sum() / keep.sum(), x)
    _close(fused[0], plain[0])
    _close(fused[1][0], plain[1][0])
    _close(linear_token_nll(x[keep], w, labels[keep], chunk_size=4).double(), nll[keep].detach())


def test_kl_is_zero_when_student_equals_teacher():
    h, w = torch.randn(10, 8), torch.randn(30, 8)
    assert linear_kl(h, w, h, w, impl="chunked").abs().item() < 1e-6


def test_label_shift_convention_on_hand_made_sequence():
    # tokens 10 11 12 13 14 15 | doc 0 = first four, doc 1 = last two; assistant tokens from index 1
    labels = torch.tensor([[10, 11, 12, 13, 14, 15]])
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1]])
    docs = torch.tensor([[0, 0, 0, 0, 1, 1]])
    # Medusa head 1 at t predicts x_{t+2}
    m = future_mask(loss_mask, docs, 2)
    assert m.tolist() == [[True, True, False, False, False, False]]
    assert shift_left(labels, 2)[m].tolist() == [12, 13]
    # d=1 is what the target's own lm_head predicts
    assert future_mask(loss_mask, docs, 1).tolist() == [[True, True, True, False, True, False]]


def test_medusa_loss_heads_and_decay_match_plain():
    torch.manual_seed(0)
    cfg = MedusaConfig(hidden_size=16, vocab_size=50, num_heads=3, num_layers=2)
    heads = MedusaHeads(cfg).double()
    for p in heads.parameters():  # non-trivial blocks so ResBlock gradients are exercised
        torch.nn.init.normal_(p, std=0.3)
    hidden = torch.randn(2, 9, 16, dtype=torch.float64)
    labels = torch.randint(0, 50, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[:, :2] = 0
    docs = torch.zeros(2, 9, dtype=torch.long)

    def run(impl):
        heads.zero_grad()
        feats = heads(hidden)
        projs = [heads.projection(k) for k in range(3)]
        if impl == "plain":
            total = 0
            for i in range(3):
                k = i + 1
                m = future_mask(mask, docs, 1 + k)
                total = total + 0.8**k * plain_linear_cross_entropy(feats[i][m], projs[i], shift_left(labels, 1 + k)[m])
        else:
            total, _, _ = medusa_loss(feats, projs, labels, mask, docs, chunk_size=5, impl="chunked")
        total.backward()
        return total.detach(), {n: p.grad.clone() for n, p in heads.named_parameters()}

    (a, ga), (b, gb) = run("chunked"), run("plain")
    _close(a, b)
    assert any("blocks.0.layers.1.linear.weight" == n for n in ga)
    for n in ga:
        _close(ga[n], gb[n])


def test_fused_losses_skip_gradient_work_without_grad(monkeypatch):
    """Under no_grad (validation) the fused losses give the same value without the autograd Function,
    whose forward computes input and weight gradients eagerly."""
    from draftheads.training import losses

    torch.manual_seed(0)
    x = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(101, 16, requires_grad=True)
    xt, wt = torch.randn(37, 8), torch.randn(101, 8)
    labels = torch.randint(0, 101, (37,))
    ce = linear_cross_entropy(x, w, labels, chunk_size=8, impl="chunked").item()
    kl = linear_kl(x, w, xt, wt, chunk_size=8, impl="chunked").item()

    def refuse(*a, **k):
        raise AssertionError("gradient path used under no_grad")

    monkeypatch.setattr(losses._ChunkedLinearCE, "apply", refuse)
    monkeypatch.setattr(losses._ChunkedLinearKL, "apply", refuse)
    with torch.no_grad():
        assert linear_cross_entropy(x, w, labels, chunk_size=8, impl="chunked").item() == pytest.approx(ce, rel=1e-6)
        assert linear_kl(x, w, xt, wt, chunk_size=8, impl="chunked").item() == pytest.approx(kl, rel=1e-6)
    with pytest.raises(AssertionError, match="gradient path"):
        linear_cross_entropy(x, w, labels, chunk_size=8, impl="chunked")


def test_aux_scale_ignores_attention_sinks():
    from draftheads.training.eagle import feature_scale

    torch.manual_seed(0)
    states = torch.randn(200, 32)  # per-token RMS about 1
    states[::50] *= 20_000.0  # the first token of each document carries a massive activation
    assert 0.8 < feature_scale(states, "median").item() < 1.2
    assert feature_scale(states, "rms").item() > 1_000
    assert feature_scale(states, "none").item() == 1.0


def test_warmup_is_a_ratio_of_the_steps():
    from draftheads.training.module import warmup_cosine

    for total in (100, 1000):
        warm = int(0.1 * total)
        assert warmup_cosine(0, total, 0.1, 0.1) == pytest.approx(1 / warm)
        assert warmup_cosine(warm - 1, total, 0.1, 0.1) == pytest.approx(1.0)
        assert warmup_cosine(total, total, 0.1, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(0, 50, 0.0, 0.2) == pytest.approx(1.0)


def test_warm_restarts_run_equal_cycles_each_warmed_up_again():
    from draftheads.training.module import warmup_cosine

    one = [warmup_cosine(s, 50, 0.1, 0.1) for s in range(50)]
    two = [warmup_cosine(s, 100, 0.1, 0.1, restarts=1) for s in range(100)]
    assert two == pytest.approx(one + one)  # two cycles of 50 steps, each warmed up to the peak again
    assert max(one) == pytest.approx(1.0) and one[-1] < 0.2
    assert warmup_cosine(120, 100, 0.1, 0.1, restarts=1) == pytest.approx(0.1)  # past the end: the floor


def test_compiled_chunks_equal_the_eager_ones():
    """impl="compiled": CE, KL (from a teacher's inputs and from a table of its log-probs) and the block
    loss give the eager chunked path's loss, gradients, argmax and acceptance, with a last chunk shorter
    than the others and chunks of another length later (one compile for any number of rows)."""
    torch.manual_seed(5)
    hs, ws = torch.randn(29, 12), torch.randn(37, 12)
    ht, wt = torch.randn(29, 10), torch.randn(37, 10)
    labels = torch.randint(0, 37, (29,))
    labels[::4] = IGNORE_INDEX
    table = torch.log_softmax(ht @ wt.T, -1)
    rows = torch.randperm(29)
    for chunk in (8, 5):
        for loss in (
            lambda a, b, impl, chunk: linear_cross_entropy(a, b, labels, chunk_size=chunk, impl=impl),
            lambda a, b, impl, chunk: linear_kl(a, b, ht, wt, chunk_size=chunk, impl=impl, return_argmax=True),
            lambda a, b, impl, chunk: linear_kl_to(a, b, table, rows, chunk_size=chunk, impl=impl, return_argmax=True),
            lambda a, b, impl, chunk: linear_block_distill(a, b, ht, wt, labels, 0.2, 0.7, 0.1, chunk_size=chunk, impl=impl),
        ):
            outs = {}
            for impl in ("chunked", "compiled"):
                a, b = hs.clone().requires_grad_(), ws.clone().requires_grad_()
                out = loss(a, b, impl, chunk)
                out = out if isinstance(out, tuple) else (out,)
                out[0].backward()
                outs[impl] = out, a.grad, b.grad
            (eager, *grads), (compiled, *grads_c) = outs["chunked"], outs["compiled"]
            _close(compiled[0].detach(), eager[0].detach())
            for x, y in zip(compiled[1:], eager[1:]):
                if x.dtype == torch.int64:
                    assert torch.equal(x, y)
                else:
                    _close(x, y)
            for x, y in zip(grads_c, grads):
                _close(x, y)
