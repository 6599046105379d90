import pytest
import torch

from draftheads.errors import DraftheadsError
from draftheads.heads.dflash import (
    BlockTiles,
    DFlashConfig,
    DFlashHead,
    block_attention_mask,
    block_flex_mask,
    block_tiles,
)
from draftheads.heads.layers import LayerSpec

SPEC = LayerSpec(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _head(**kw) -> DFlashHead:
    torch.manual_seed(0)
    cfg = DFlashConfig(layer=SPEC, vocab_size=50, target_layer_ids=(1, 2), mask_token_id=49, block_size=3,
                       target_hidden_size=24, **{"num_layers": 2, **kw})
    head = DFlashHead(cfg)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return head.eval()


def test_block_mask_by_hand_two_anchors():
    # one row of 6 tokens, two documents [0, 0, 0, 0, 1, 1]; blocks of 2 anchored at 3 and 5
    m = block_attention_mask(torch.tensor([[3, 5]]), torch.tensor([[0, 0, 0, 0, 1, 1]]), block_size=2)[0, 0]
    ctx, own = m[:, :6].int().tolist(), m[:, 6:].int().tolist()
    assert ctx == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0],  # block at 3: its document before position 3
                   [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 1, 0]]  # block at 5: document 1 before position 5
    assert own == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]  # non-causal within a block
    causal = block_attention_mask(torch.tensor([[3, 5]]), torch.tensor([[0, 0, 0, 0, 1, 1]]), 2, causal=True)
    assert causal[0, 0, :, 6:].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    window = block_attention_mask(torch.tensor([[3, -1]]), torch.zeros(1, 6, dtype=torch.long), 2, sliding_window=2)
    assert window[0, 0, 0, :6].int().tolist() == [0, 1, 1, 0, 0, 0]
    assert window[0, 0, 2, :6].int().tolist() == [0] * 6  # no anchor: only its own block


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, 3)])
def test_the_flex_block_mask_attends_where_the_dense_mask_does(causal, window):
    anchors = torch.tensor([[3, 8, -1], [1, 5, 9]])
    docs = torch.tensor([[0] * 6 + [1] * 6, [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, -1, -1]])  # the second row padded
    dense = block_attention_mask(anchors, docs, 3, causal, window)[:, 0]
    flex = block_flex_mask(anchors, docs, 3, causal, window)
    b, q, k = dense.shape
    rows, qi, ki = torch.arange(b)[:, None, None], torch.arange(q)[None, :, None], torch.arange(k)[None, None, :]
    assert torch.equal(flex.mask_mod(rows, 0, qi, ki).expand(b, q, k), dense)


def test_the_head_gives_the_same_blocks_through_flex_attention():
    head = _head()
    t = 12
    feats, embeds = torch.randn(1, t, 2 * 24), torch.randn(1, t, SPEC.hidden_size)
    anchors, docs = torch.tensor([[2, 6, 10]]), torch.tensor([[0] * 5 + [1] * 7])
    kv = head.context_kv(head.context(feats), torch.arange(t)[None])
    q, qpos = head.block_inputs(embeds[:, anchors[0]]), (anchors[0, :, None] + torch.arange(3)).reshape(1, -1)
    with torch.no_grad():  # FlexAttention runs forward only on CPU
        want = head(q, qpos, kv, block_attention_mask(anchors, docs, 3))
        got = head(q, qpos, kv, block_flex_mask(anchors, docs, 3))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, 3)])
def test_block_tiles_hold_the_dense_mask_inside_their_spans(causal, window):
    anchors = torch.tensor([[3, 8, -1], [1, 5, 9]])
    docs = torch.tensor([[0] * 6 + [1] * 6, [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, -1, -1]])
    dense = block_attention_mask(anchors, docs, 3, causal, window)[:, 0]  # [B, 9, 12 + 9]
    for rows in (3, 6, 128):
        tiles = block_tiles(anchors, docs, 3, causal, window, rows=rows)
        assert [r for r, _, _ in tiles.tiles] == [slice(i, min(i + max(rows // 3, 1) * 3, 9))
                                                  for i in range(0, 9, max(rows // 3, 1) * 3)]
        for r, c, m in tiles.tiles:
            want = dense[:, r]
            assert torch.equal(m[:, 0, :, : c.stop - c.start], want[:, :, c])  # the context span
            assert not want[:, :, :12][:, :, torch.arange(12) < c.start].any()  # nothing seen outside it
            assert not want[:, :, :12][:, :, torch.arange(12) >= c.stop].any()
            assert torch.equal(m[:, 0, :, c.stop - c.start:], want[:, :, 12:][:, :, r])  # own blocks
            assert not want[:, :, 12:][:, :, torch.arange(9) < r.start].any()
            assert not want[:, :, 12:][:, :, torch.arange(9) >= r.stop].any()
    first = block_tiles(anchors, docs, 3, rows=3).tiles[0]
    assert first[1] == slice(0, 3)  # row 0 block at 3 reads 0..2, row 1 block at 1 reads 0


def test_the_head_gives_the_same_blocks_and_gradients_through_tiles():
    head = _head()
    t = 14
    feats, embeds = torch.randn(2, t, 2 * 24), torch.randn(2, t, SPEC.hidden_size)
    anchors = torch.tensor([[2, 6, 7, 11], [1, 4, 12, -1]])
    docs = torch.tensor([[0] * 5 + [1] * 9, [0] * 8 + [1] * 4 + [-1] * 2])
    qpos = (anchors.clamp(min=0)[:, :, None] + torch.arange(3)).reshape(2, -1)

    def run(mask):
        head.zero_grad()
        kv = head.context_kv(head.context(feats), torch.arange(t).expand(2, t))
        q = head.block_inputs(embeds.gather(1, anchors.clamp(min=0)[:, :, None].expand(-1, -1, SPEC.hidden_size)))
        out = head(q, qpos, kv, mask)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out, [p.grad.clone() for p in head.parameters() if p.grad is not None]

    want, want_grads = run(block_attention_mask(anchors, docs, 3))
    for rows in (3, 6):
        tiles = block_tiles(anchors, docs, 3, rows=rows)
        assert isinstance(tiles, BlockTiles) and len(tiles.tiles) == 4 // (rows // 3)
        got, grads = run(tiles)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for g, w in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_many_blocks_in_one_pass_equal_each_block_alone():
    head = _head()
    t, h = 10, SPEC.hidden_size
    feats = torch.randn(1, t, 2 * 24)
    pos = torch.arange(t)[None]
    embeds = torch.randn(1, t, h)
    anchors = torch.tensor([[2, 5, 9]])
    ctx = head.context(feats)
    kv = head.context_kv(ctx, pos)
    q = head.block_inputs(embeds[:, anchors[0]])
    qpos = (anchors[0, :, None] + torch.arange(3)).reshape(1, -1)
    mask = block_attention_mask(anchors, torch.zeros(1, t, dtype=torch.long), 3)
    together = head(q, qpos, kv, mask)
    for j, a in enumerate(anchors[0].tolist()):  # the block alone, with the context before its anchor only
        kv_a = head.context_kv(ctx[:, :a], pos[:, :a])
        alone = head(head.block_inputs(embeds[:, [a]]), qpos[:, 3 * j: 3 * j + 3], kv_a,
                     torch.ones(1, 1, 3, a + 3, dtype=torch.bool))
        torch.testing.assert_close(together[:, 3 * j: 3 * j + 3], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw,message", [
    ({"target_layer_ids": (2, 1)}, "ascending"),
    ({"target_layer_ids": (0, 1)}, ">= 1"),
    ({"block_size": 129}, "2..128"),
    ({"num_layers": 6}, "1..5"),
    ({"mask_token_id": 50}, "below vocab_size"),
    ({"draft_vocab_size": 51}, "1..vocab_size"),
])
def test_bad_config_is_one_error(kw, message):
    base = dict(layer=SPEC, vocab_size=50, target_layer_ids=(1, 2), mask_token_id=49)
    with pytest.raises(DraftheadsError, match=message):
        DFlashConfig(**{**base, **kw})


def test_compiled_flex_attention_is_traced_without_ddp_optimizer(monkeypatch):
    """Inside a DDP forward, Dynamo would give the graph to DDPOptimizer, which older torch releases refuse
    for higher-order ops such as FlexAttention; the compiled call turns it off."""
    from types import SimpleNamespace

    import torch._dynamo
    from torch._dynamo.backends import distributed
    from torch.nn.parallel import DistributedDataParallel

    from draftheads.heads.dflash import compiled_flex_attention

    def refuse(self, gm, example_inputs):
        raise NotImplementedError("DDPOptimizer backend: Found a higher order op in the graph")

    monkeypatch.setattr(distributed.DDPOptimizer, "compile_fn", refuse)
    monkeypatch.setattr(DistributedDataParallel, "_active_ddp_module", SimpleNamespace(bucket_bytes_cap=1 << 20))
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (8, 16, 16))
    mask = block_flex_mask(torch.tensor([[1, 5]]), torch.zeros(1, 8, dtype=torch.long), 4)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=block_attention_mask(torch.tensor([[1, 5]]), torch.zeros(1, 8, dtype=torch.long), 4))
    with torch.no_grad():  # FlexAttention runs forward only on CPU
        plain = torch.compile(torch.nn.attention.flex_attention.flex_attention, dynamic=False, backend="eager")
        with pytest.raises(Exception, match="higher order op"):  # what DDP training met
            plain(q, k, v, block_mask=mask)
        torch._dynamo.reset()
        got = compiled_flex_attention(backend="eager")(q, k, v, block_mask=mask)
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
