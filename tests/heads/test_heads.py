import pytest
import torch

from draftheads.errors import DraftheadsError
from draftheads.heads import (
    DFlashConfig,
    DFlashHead,
    Eagle3Config,
    Eagle3Head,
    EagleConfig,
    EagleHead,
    LayerSpec,
    MedusaConfig,
    MedusaHeads,
    check_head_fits_target,
    load_head,
    save_head,
)
from draftheads.heads.vocab import DraftVocab, build_draft_vocab, token_counts

SPEC = LayerSpec(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _randomize(m):
    torch.manual_seed(0)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return m


def _eagle3(**kw):
    cfg = Eagle3Config(layer=SPEC, vocab_size=60, draft_vocab_size=20, aux_layer_ids=(1, 2, 3), **kw)
    return _randomize(Eagle3Head(cfg))


def test_medusa_shapes_and_distinct_layers():
    heads = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=60, num_heads=4, num_layers=3))
    assert heads(torch.randn(2, 5, 32)).shape == (4, 2, 5, 32)
    assert heads.logits(torch.randn(2, 5, 32)).shape == (4, 2, 5, 60)
    layers = [layer for b in heads.blocks for layer in b.layers]
    assert len({id(m) for m in layers}) == 12
    assert len({p.data_ptr() for layer in layers for p in layer.parameters()}) == 24
    assert all((layer.linear.weight == 0).all() for layer in layers)  # zero-init: starts as identity


def test_medusa_shared_lm_head_and_token_map():
    w = torch.randn(60, 32)
    heads = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=60, num_heads=2, share_lm_head=True, draft_vocab_size=5))
    heads.init_from_target(w, token_map=torch.tensor([3, 7, 9, 20, 59]))
    assert not any("lm_heads" in n for n, _ in heads.named_parameters())
    h = torch.randn(1, 1, 32)
    torch.testing.assert_close(heads.logits(h, w)[0, 0, 0], heads(h)[0, 0, 0] @ w[[3, 7, 9, 20, 59]].T)
    assert heads.to_target_ids(torch.tensor([4])).item() == 59


def test_eagle_shapes_and_no_input_norm():
    head = _randomize(EagleHead(EagleConfig(layer=SPEC, vocab_size=60)))
    out, (k, v) = head(torch.randn(2, 7, 32), torch.randn(2, 7, 32), torch.arange(7).expand(2, 7))
    assert out.shape == (2, 7, 32) and k.shape == (2, 2, 7, 8)
    names = {n for n, _ in head.named_parameters()}
    assert "fc.weight" in names and "fc.bias" not in names
    assert not any("input_layernorm" in n for n in names) and not any(n.startswith("norm") for n in names)


def test_eagle3_shapes_and_duplicate_ids_rejected():
    head = _eagle3()
    assert head.fc.weight.shape == (32, 96)
    assert head.layers[0].self_attn.q_proj.weight.shape == (32, 64)  # 2H in
    assert head.lm_head.weight.shape == (20, 32)
    with pytest.raises(DraftheadsError, match="duplicates"):
        Eagle3Config(layer=SPEC, vocab_size=60, draft_vocab_size=20, aux_layer_ids=(2, 2, 3))


def test_widened_mlp_keeps_the_function_and_trains_its_new_units():
    head = _eagle3().double()
    aux, emb = torch.randn(2, 6, 96, dtype=torch.float64), torch.randn(2, 6, 32, dtype=torch.float64)
    pos = torch.arange(6).expand(2, 6)
    before = head.normed(head(emb, head.fuse(aux), pos)[0])
    mlp = head.layers[0].mlp
    old_gate = mlp.gate_proj.weight.clone()
    mlp.widen(96)
    assert (mlp.gate_proj.weight.shape, mlp.up_proj.weight.shape, mlp.down_proj.weight.shape) == (
        (96, 32), (96, 32), (32, 96))
    assert torch.equal(mlp.gate_proj.weight[:64], old_gate) and mlp.gate_proj.weight[64:].abs().sum() > 0
    after = head.normed(head(emb, head.fuse(aux), pos)[0])
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    after.square().sum().backward()
    assert mlp.down_proj.weight.grad[:, 64:].abs().sum() > 0  # the new units leave zero on the first step
    with pytest.raises(DraftheadsError, match="intermediate_size 32 is below the head's 96"):
        mlp.widen(32)


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("block", [None, 4])  # one query block, or three with the last one padded
def test_eagle3_ttt_equals_step_by_step_drafting(monkeypatch, block, num_layers):
    """TTT step j at t == drafting j tokens on top of the real prefix 0..t with a growing draft KV (each
    layer's)."""
    from draftheads.heads import layers

    if block:
        monkeypatch.setattr(layers, "OWN_BLOCK", block)
    head = _eagle3(num_layers=num_layers).double()
    b, t = 1, 10
    aux = torch.randn(b, t, 96, dtype=torch.float64)
    emb = torch.randn(4, b, t, 32, dtype=torch.float64)  # step j's embeddings
    pos = torch.arange(t).expand(b, t)
    causal = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1).expand(b, 1, t, t)
    outs = head.ttt(aux, lambda j: emb[j], pos, causal, steps=4)

    g = head.fuse(aux)
    h0, kv0 = head(emb[0], g, pos, mask=causal)
    assert len(kv0) == num_layers
    torch.testing.assert_close(head.normed(h0), outs[0])
    for col in (0, 3, 5, 9):
        past = [(k[:, :, : col + 1], v[:, :, : col + 1]) for k, v in kv0]  # the real prefix, then the drafts'
        hidden = h0[:, col : col + 1]
        for j in range(1, 4):
            hidden, kv = head(emb[j][:, col : col + 1], hidden, pos[:, col : col + 1] + j,
                              mask=torch.zeros(1, 1, 1, col + 1 + j, dtype=torch.float64), past_kv=past)
            past = [(torch.cat([p[0], n[0]], 2), torch.cat([p[1], n[1]], 2)) for p, n in zip(past, kv)]
            torch.testing.assert_close(head.normed(hidden)[:, 0], outs[j][:, col])


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("block", [None, 3])
def test_eagle3_ttt_at_the_scored_positions_gives_the_same_loss_and_gradients(monkeypatch, block, num_layers):
    """Everything but step 0's keys and values runs only where the loss scores some step: rows of two documents (a prompt, then an answer,
    then a second conversation) and rows with different numbers of kept positions (the shorter padded):
    the same outputs there, and the same EAGLE-3 loss and gradients as steps run everywhere."""
    from draftheads.heads import layers
    from draftheads.training.data import doc_causal_mask
    from draftheads.training.losses import eagle3_loss, ttt_scored_positions

    if block:
        monkeypatch.setattr(layers, "OWN_BLOCK", block)
    g = torch.Generator().manual_seed(5)
    head = _eagle3(num_layers=num_layers).double()
    b, t, steps = 3, 16, 4
    doc = torch.tensor([[0] * 9 + [1] * 7, [0] * 16, [0] * 5 + [1] * 8 + [-1] * 3])
    answer = torch.tensor([[0] * 4 + [1] * 5 + [0] * 2 + [1] * 5, [0] * 3 + [1] * 13, [0] * 2 + [1] * 3 + [0] * 6 + [1] * 2 + [0] * 3])
    pos = torch.cat([torch.arange(9), torch.arange(7)]).expand(b, t).clone()
    pos[1], pos[2] = torch.arange(t), torch.cat([torch.arange(5), torch.arange(11)])
    aux = torch.randn(b, t, 96, generator=g, dtype=torch.float64)
    emb = torch.randn(steps, b, t, 32, generator=g, dtype=torch.float64)
    want = torch.randint(-1, 20, (b, t), generator=g)
    last = torch.randn(b, t, 32, generator=g, dtype=torch.float64)
    teacher = torch.randn(20, 32, generator=g, dtype=torch.float64)
    mask = doc_causal_mask(doc, dtype=torch.float64)
    keep = ttt_scored_positions(answer, doc, want, steps)
    assert 0 < keep.sum(1).min() < keep.sum(1).max() < t  # rows padded, positions left out

    def run(kept):
        head.zero_grad()
        outs = head.ttt(aux, lambda j: emb[j], pos, mask, steps=steps, keep=kept)
        loss = eagle3_loss(outs, last, answer, doc, head.lm_head.weight, teacher, want, impl="chunked")[0]
        loss.backward()
        return outs, loss, [p.grad.clone() for p in head.parameters() if p.grad is not None]

    (full, loss_full, grads_full), (kept, loss_kept, grads_kept) = run(None), run(keep)
    for j in range(steps):
        torch.testing.assert_close(kept[j][keep], full[j][keep])
        assert kept[j][~keep].abs().max() == 0
    torch.testing.assert_close(loss_kept, loss_full)
    assert len(grads_kept) == len(grads_full) > 0
    for a, w in zip(grads_kept, grads_full):
        torch.testing.assert_close(a, w)


def test_prefix_and_own_attention_equals_one_masked_attention():
    """Blocks of query rows (the last one shorter), GQA, rows of one and of two documents, rows whose
    documents start at the same place (blocks past it read no earlier key), a row and then every row seeing
    no prefix key, and no own-position keys at all (the masked attention in blocks): the output and every
    gradient equal one attention over all keys with diagonal own-position blocks."""
    import torch.nn.functional as F

    from draftheads.heads.layers import prefix_and_own_attention

    g = torch.Generator().manual_seed(0)
    b, h, kvh, t, d = 2, 4, 2, 10, 8
    leaf = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    pos = torch.arange(t)
    diag = torch.full((t, t), float("-inf"), dtype=torch.float64).fill_diagonal_(0.0).expand(b, 1, t, t)
    for n, doc in ((0, [[0] * 3 + [1] * 7, [0] * 6 + [1] * 4]), (1, [[0] * 6 + [1] * 4, [0] * 10]),
                   (2, [[0] * 3 + [1] * 7, [0] * 3 + [1] * 7]), (3, [[0] * 6 + [1] * 4, [0] * 10])):
        doc = torch.tensor(doc)
        seen = (doc[:, :, None] == doc[:, None]) & (pos[:, None] >= pos[None])
        seen[1, 7] = n == 0  # a row whose own-position keys are all it sees (with none: one that sees every key)
        mask = torch.zeros(b, 1, t, t, dtype=torch.float64).masked_fill(~seen[:, None], float("-inf"))
        q, pk, pv = leaf(b, h, t, d), leaf(b, kvh, t, d), leaf(b, kvh, t, d)
        ok, ov = [leaf(b, kvh, t, d) for _ in range(n)], [leaf(b, kvh, t, d) for _ in range(n)]
        leaves = [q, pk, pv, *ok, *ov]
        want = F.scaled_dot_product_attention(q, torch.cat([pk, *ok], 2), torch.cat([pv, *ov], 2),
                                              attn_mask=torch.cat([mask, *[diag] * n], -1), enable_gqa=True)
        grads_want = torch.autograd.grad(want.pow(2).sum(), leaves)
        for block in (4, 5, 16):
            got = prefix_and_own_attention(q, (pk, pv), (ok, ov), mask, block=block)
            torch.testing.assert_close(got, want)
            for a, w in zip(torch.autograd.grad(got.pow(2).sum(), leaves), grads_want):
                torch.testing.assert_close(a, w)
    blind = torch.full_like(mask, float("-inf"))  # no query sees a prefix key: own positions only
    want = F.scaled_dot_product_attention(q, torch.cat([pk, *ok], 2), torch.cat([pv, *ov], 2),
                                          attn_mask=torch.cat([blind, *[diag] * n], -1), enable_gqa=True)
    torch.testing.assert_close(prefix_and_own_attention(q, (pk, pv), (ok, ov), blind, block=4), want)


@pytest.mark.parametrize("make", [
    lambda: MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=60, num_heads=3, num_layers=2, draft_vocab_size=10)),
    lambda: _randomize(EagleHead(EagleConfig(layer=SPEC, vocab_size=60, draft_vocab_size=12))),
    lambda: _eagle3(),
    lambda: DFlashHead(DFlashConfig(layer=SPEC, vocab_size=60, target_layer_ids=(1, 3), mask_token_id=59,
                                    draft_vocab_size=20, num_layers=2, block_size=8)),
])
def test_save_load_round_trip(tmp_path, make):
    head = _randomize(make())
    save_head(head, tmp_path / "h")
    loaded, meta = load_head(tmp_path / "h")
    assert meta["head_type"] == head.head_type and type(loaded) is type(head)
    assert loaded.config == head.config
    for (n, a), (m, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert n == m and torch.equal(a, b), n


def test_head_target_mismatch_is_one_clear_error():
    from types import SimpleNamespace

    info = SimpleNamespace(name="t", hidden_size=64, vocab_size=60, num_layers=4)
    with pytest.raises(DraftheadsError, match="hidden size 32 .* has 64"):
        check_head_fits_target(_eagle3(), info)
    info = SimpleNamespace(name="t", hidden_size=32, vocab_size=61, num_layers=4)
    with pytest.raises(DraftheadsError, match="vocab size 60 .* has 61"):
        check_head_fits_target(_eagle3(), info)
    info = SimpleNamespace(name="t", hidden_size=32, vocab_size=60, num_layers=2)
    with pytest.raises(DraftheadsError, match="target layer ids"):
        check_head_fits_target(_eagle3(), info)


def test_draft_vocab_coverage_and_maps():
    counts = token_counts([torch.tensor([5, 5, 5, 5, 2, 2, 9, 1, 1, 1])], 12)
    v = build_draft_vocab(counts, coverage=0.9)  # 5:4, 1:3, 2:2 -> 9/10
    assert v.draft_ids.tolist() == [1, 2, 5] and v.coverage == pytest.approx(0.9)
    assert v.d2t.tolist() == [1, 1, 3]
    assert (torch.arange(3) + v.d2t).tolist() == [1, 2, 5]
    assert v.t2d.nonzero().flatten().tolist() == [1, 2, 5]
    assert build_draft_vocab(counts, size=1).draft_ids.tolist() == [5]
    assert DraftVocab.from_d2t(v.d2t, 12).draft_ids.tolist() == [1, 2, 5]


def test_draft_vocab_sized_for_held_out_coverage():
    train = token_counts([torch.tensor([5] * 50 + [1] * 30 + [2] * 15 + [9] * 5)], 12)
    held = token_counts([torch.tensor([5] * 40 + [1] * 20 + [2] * 20 + [7] * 20)], 12)
    # 95 % of the training targets need {5, 1, 2}; they cover only 80 % of held-out text
    v = build_draft_vocab(train, coverage=0.95)
    assert v.draft_ids.tolist() == [1, 2, 5] and v.held_out_coverage is None
    v = build_draft_vocab(train, coverage=0.95, held_out=held)
    assert v.held_out_coverage >= 0.95 and 7 in v.draft_ids.tolist()
    assert v.draft_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 9]  # unseen tokens come in id order
    # tokens unseen in the training targets are ranked by the tie-break counts (e.g. prompt text)
    tie = torch.zeros(12, dtype=torch.int64)
    tie[7] = 3
    v = build_draft_vocab(train, coverage=0.95, held_out=held, tie_break=tie)
    assert v.draft_ids.tolist() == [1, 2, 5, 7, 9] and v.held_out_coverage == pytest.approx(1.0)
    assert build_draft_vocab(train, coverage=1.0, held_out=held, max_size=2).size == 2


def test_shipped_head_names_resolve(tmp_path, monkeypatch):
    from draftheads.heads import base, load_head, save_head

    monkeypatch.setattr(base, "shipped_head_path", lambda name: tmp_path / "heads" / base.SHIPPED_HEADS[name])
    with pytest.raises(DraftheadsError, match="make reference-head"):
        load_head("reference")
    head = _eagle3()
    save_head(head, tmp_path / "heads" / "smollm2-135m-eagle3")
    for name in ("reference", "smollm2-135m-eagle3"):
        got, meta = load_head(name)
        assert meta["head_type"] == "eagle3"
        for k, v in head.state_dict().items():
            assert torch.equal(got.state_dict()[k], v), k


def test_shipped_reference_head_loads_if_installed():
    """The committed reference head (when the package ships one) loads and fits the default target's shape."""
    from draftheads.heads import base, load_head

    path = base.shipped_head_path("reference")
    if not (path / "model.safetensors").is_file():
        pytest.skip("no reference head shipped in this checkout")
    head, meta = load_head("reference")
    assert meta["head_type"] == "eagle3" and head.config.vocab_size == 49152 and head.config.hidden_size == 576
    assert (path / "CARD.md").is_file() and (path / "model.safetensors").stat().st_size <= 25 * 2**20


def test_a_deeper_eagle3_head_drafts_through_each_layers_cache_as_its_uncached_forward():
    """The proposer's path: entries written into the draft K/V in two forwards (the buffer growing in
    between), each layer its own, give the outputs of one uncached forward over all of them."""
    from draftheads.inference.draft_kv import DraftKV

    head = _eagle3(num_layers=3).double()
    g = torch.Generator().manual_seed(2)
    t = 7
    emb, hidden = (torch.randn(1, t, 32, generator=g, dtype=torch.float64) for _ in range(2))
    pos = torch.arange(t)[None]
    causal = torch.full((t, t), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    want, _ = head(emb, hidden, pos, mask=causal)
    kv = DraftKV(2, 8, torch.float64, "cpu", capacity=4, layers=3)
    kv.add(0)
    outs = []
    for a, b in ((0, 4), (4, t)):
        step = kv.step([0], pos[:, a:b], b)
        outs.append(head(emb[:, a:b], hidden[:, a:b], pos[:, a:b], mask=causal[:, :, a:b, :b], cache=step)[0])
    assert kv.k.shape[0] == 3 and kv.k.shape[3] == 8  # a layer each; grown past its first capacity
    torch.testing.assert_close(torch.cat(outs, 1), want)
