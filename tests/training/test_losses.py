import pytest
import torch

from draftheads.heads.medusa import MedusaConfig, MedusaHeads
from draftheads.training.losses import (
    IGNORE_INDEX,
    future_mask,
    linear_cross_entropy,
    linear_kl,
    medusa_loss,
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
