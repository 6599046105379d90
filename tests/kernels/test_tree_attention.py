import pytest
import torch

from draftheads.inference.tree import ancestor_mask
from draftheads.kernels.tree_attention import (
    MIN_KEYS_PER_SPLIT,
    ancestor_words,
    attention_plan,
    choose_splits,
    paged_tree_attention_fwd,
    paged_tree_attention_ref,
    supports,
    tile_sizes,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _case(rows, heads, kv_heads, dim, dtype, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    total_blocks = sum(-(-(p + len(par)) // block_size) for p, par in rows) + 2
    k = torch.randn(total_blocks, block_size, kv_heads, dim, generator=g).to(DEVICE, dtype)
    v = torch.randn(total_blocks, block_size, kv_heads, dim, generator=g).to(DEVICE, dtype)
    perm = torch.randperm(total_blocks, generator=g).tolist()  # scattered, non-contiguous blocks
    tables, masks, token_row, nxt = [], [], [], 0
    for r, (prefix, parents) in enumerate(rows):
        n = -(-(prefix + len(parents)) // block_size)
        tables.append(perm[nxt: nxt + n])
        nxt += n
        masks.append(ancestor_mask(parents))
        token_row += [r] * len(parents)
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(rows), width, dtype=torch.int32)
    for r, t in enumerate(tables):
        bt[r, : len(t)] = torch.tensor(t)
    t_total = len(token_row)
    q = torch.randn(t_total, heads, dim, generator=g).to(DEVICE, dtype)
    anc, limit = ancestor_words(masks, [p for p, _ in rows], DEVICE)
    args = (q, k, v, torch.tensor(token_row, dtype=torch.int32, device=DEVICE), anc, limit,
            torch.tensor([p for p, _ in rows], dtype=torch.int32, device=DEVICE), bt.to(DEVICE), dim**-0.5)
    return args


def _tree(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [-1] + [int(torch.randint(i, (1,), generator=g)) for i in range(1, n)]


def _assert_matches(got, want, dtype, what=""):
    """Elementwise |got - want| <= tol * (1 + |want|); on failure, name the first mismatching
    (token, head, dim) indices with both values."""
    got, want = got.float().cpu(), want.float().cpu()
    err = (got - want).abs()
    bad = (err > TOL[dtype] * (1 + want.abs())).nonzero()
    if len(bad):
        shown = [(tuple(i), round(got[tuple(i)].item(), 5), round(want[tuple(i)].item(), 5)) for i in bad[:8].tolist()]
        pytest.fail(f"{what}: {len(bad)} of {got.numel()} mismatch (max err {err.max().item():.3e}); "
                    f"(token, head, dim), kernel, reference: {shown}")


def _parity(rows, heads=4, kv_heads=1, dim=32, dtype=torch.float32, block_size=16, num_splits=None, seed=0):
    args = _case(rows, heads, kv_heads, dim, dtype, block_size, seed)
    got = paged_tree_attention_fwd(*args, num_splits=num_splits)
    want = paged_tree_attention_ref(*args)
    _assert_matches(got, want, dtype, f"rows {[(p, len(t)) for p, t in rows]} heads {heads}/{kv_heads} dim {dim} "
                                      f"{dtype} blocks of {block_size}, splits {num_splits}")
    return args, got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_matches_reference_odd_shapes(dtype):
    # 3 rows, trees of 1/7/13 tokens, block size 16, contexts 37 / 0 / 20
    rows = [(37, _tree(1, 0)), (0, _tree(7, 1)), (20, _tree(13, 2))]
    _parity(rows, heads=4, kv_heads=2, dim=64, dtype=dtype)


def test_kernel_large_tree_and_head_dim_128():
    rows = [(5, _tree(70, 3))]  # ancestor bits beyond 64 use the third word
    args = _case(rows, heads=2, kv_heads=1, dim=128, dtype=torch.float32)
    torch.testing.assert_close(paged_tree_attention_fwd(*args), paged_tree_attention_ref(*args), atol=3e-5, rtol=3e-5)


def _dense(args, allowed):
    """Attention of the first ``len(allowed)`` query tokens with an explicit visibility over their row's
    positions (``allowed[i]`` [S])."""
    q, k, v, tr, anc, lim, pre, bt, scale = args
    bs = k.shape[1]
    out = torch.empty(len(allowed), *q.shape[1:], dtype=torch.float32, device=q.device)
    for i in range(len(allowed)):
        r = int(tr[i])
        pos = torch.arange(allowed[i].numel(), device=q.device)
        kk = k[bt[r][pos // bs].long(), pos % bs].float().repeat_interleave(q.shape[1] // k.shape[2], 1)
        vv = v[bt[r][pos // bs].long(), pos % bs].float().repeat_interleave(q.shape[1] // k.shape[2], 1)
        s = torch.einsum("hd,shd->hs", q[i].float(), kk) * scale
        out[i] = torch.einsum("hs,shd->hd", s.masked_fill(~allowed[i][None].to(s.device), float("-inf")).softmax(-1), vv)
    return out


@pytest.mark.parametrize("prompt", [129, pytest.param(300, marks=pytest.mark.slow)])
def test_prefill_longer_than_the_tree_bits_is_causal(prompt):
    """A prefill is a chain of any length: each token sees the prefix and the chain up to itself (its query
    tokens span several tiles, each with its own mask-free bound)."""
    rows = [(3, [-1] + list(range(prompt - 1))), (0, _tree(9, 4))]
    args = _case(rows, heads=2, kv_heads=1, dim=16, dtype=torch.float32)
    got = paged_tree_attention_fwd(*args)
    want = paged_tree_attention_ref(*args)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    causal = torch.zeros(prompt, 3 + prompt, dtype=torch.bool)
    for i in range(prompt):
        causal[i, : 3 + i + 1] = True
    torch.testing.assert_close(want[:prompt].float(), _dense(args, causal), atol=2e-5, rtol=2e-5)
    anc = args[4]
    assert bool((anc[:prompt] == -1).all()), "a chain's words are all -1"
    words, _ = ancestor_words([ancestor_mask(_tree(130, 5))], [0], DEVICE)  # a tree over 128 tokens: 5 words
    assert words.shape == (130, 5)


@pytest.mark.parametrize("dim,kv_heads", [(80, 1), (96, 2), (112, 4)])
def test_head_dims_that_are_not_a_power_of_two(dim, kv_heads):
    rows = [(21, _tree(6, 6)), (4, [-1])]
    args = _case(rows, heads=4, kv_heads=kv_heads, dim=dim, dtype=torch.float32)
    torch.testing.assert_close(paged_tree_attention_fwd(*args), paged_tree_attention_ref(*args), atol=3e-5, rtol=3e-5)


def test_kv_blocks_smaller_than_16():
    rows = [(13, _tree(5, 7))]
    args = _case(rows, heads=2, kv_heads=1, dim=32, dtype=torch.float32, block_size=4)
    torch.testing.assert_close(paged_tree_attention_fwd(*args), paged_tree_attention_ref(*args), atol=3e-5, rtol=3e-5)


def test_reference_matches_dense_attention():
    rows = [(3, [-1, 0, 0])]
    q, k, v, tr, anc, lim, pre, bt, scale = _case(rows, heads=2, kv_heads=2, dim=16, dtype=torch.float32)
    want = paged_tree_attention_ref(q, k, v, tr, anc, lim, pre, bt, scale)
    pos = torch.arange(6, device=q.device)
    kk, vv = k[bt[0][pos // 16].long(), pos % 16], v[bt[0][pos // 16].long(), pos % 16]
    allowed = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 1]], dtype=torch.bool, device=q.device)
    s = torch.einsum("thd,shd->ths", q, kk) * scale
    s = s.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
    torch.testing.assert_close(want, torch.einsum("ths,shd->thd", s, vv), atol=1e-5, rtol=1e-5)


# One axis at a time around a small base case: two rows (a 7-token tree after 37 keys, a 3-token tree
# with no prefix), 4 query heads on 1 KV head, head size 32, KV blocks of 16, fp32.
BASE = [(37, _tree(7, 11)), (0, _tree(3, 12))]


@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (8, 1), (6, 2), (4, 4)], ids=["gqa4", "gqa8", "gqa3", "mha"])
def test_gqa_groups(heads, kv_heads):
    _parity(BASE, heads=heads, kv_heads=kv_heads)


@pytest.mark.parametrize("dim", [64, 80, 128, pytest.param(256, marks=pytest.mark.slow)])
def test_head_dims(dim):
    _parity(BASE, dim=dim)


@pytest.mark.parametrize("context,splits", [(1, None), (37, None), (1000, None), (1000, 4)])
def test_context_lengths(context, splits):
    _parity([(context, _tree(5, 13)), (2, _tree(4, 14))], num_splits=splits)


@pytest.mark.parametrize("size", [1, 16, 64, 129])
def test_tree_sizes(size):
    """Trees of any size: 129 tokens take five ancestor words and several query tiles per row."""
    args, _ = _parity([(20, _tree(size, 15))], heads=2 if size > 64 else 4)
    assert args[4].shape[1] == -(-size // 32)


@pytest.mark.parametrize("block_size", [1, 8, 32, 128])
def test_kv_block_sizes(block_size):
    """Blocks smaller than a key tile (several per tile) and larger ones (a tile inside one block)."""
    _parity([(150, _tree(6, 16)), (9, _tree(3, 17))], block_size=block_size)


@pytest.mark.parametrize("splits", [2, 3, 7])
def test_context_splits_with_uneven_rows(splits):
    """Splits of rows of different lengths, some left with no keys, and a chain row among tree rows."""
    rows = [(300, _tree(5, 18)), (0, _tree(2, 19)), (40, [-1, 0, 1, 2]), (130, [-1])]
    _parity(rows, heads=4, kv_heads=2, num_splits=splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtypes_with_splits(dtype):
    _parity([(200, _tree(9, 20)), (5, _tree(4, 21))], heads=8, kv_heads=2, dim=64, dtype=dtype, num_splits=3)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_context_large_tree_gqa8(dtype):
    _parity([(1000, _tree(64, 22)), (333, _tree(16, 23))], heads=8, kv_heads=1, dim=128, dtype=dtype, num_splits=4)


def test_query_as_the_engine_passes_it():
    """The engine entry hands the kernel a transposed view [T, H, D] of [1, H, T, D]."""
    q, *rest = _case(BASE, 4, 1, 32, torch.float32)
    view = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not view.is_contiguous()
    torch.testing.assert_close(paged_tree_attention_fwd(view, *rest), paged_tree_attention_ref(q, *rest),
                               atol=2e-5, rtol=2e-5)


def test_ancestor_words_round_trip():
    """Unpacking the words gives back each tree token's mask; chains are all -1 and causal by their limit."""
    parents = [_tree(1, 0), _tree(33, 1), [-1, 0, 1], _tree(33, 2), _tree(70, 3)]
    prefixes = [4, 0, 9, 2, 1]
    masks = [ancestor_mask(p) for p in parents]
    anc, limit = ancestor_words(masks, prefixes, "cpu")
    assert anc.shape == (sum(map(len, parents)), 3) and anc.dtype == torch.int32
    first = 0
    for m, prefix in zip(masks, prefixes):
        n = m.shape[0]
        words, lim = anc[first: first + n], limit[first: first + n]
        chain = bool((m == torch.ones(n, n, dtype=torch.bool).tril()).all())
        if chain:
            assert bool((words == -1).all()) and lim.tolist() == [prefix + i + 1 for i in range(n)]
        else:
            bits = (words[:, :, None] >> torch.arange(32)) & 1
            assert torch.equal(bits.flatten(1)[:, :n].bool(), m)
            assert lim.tolist() == [prefix + n] * n
        first += n


def test_plan_tiles_and_split_choice():
    plan = attention_plan([3, 0, 40], [10, 5, 0], group=4, head_dim=80, device="cpu", elem_bytes=2)
    assert (plan.block_m, plan.tokens_per_tile, plan.block_n) == (128, 32, 64)
    assert plan.tiles.tolist() == [[0, 0, 0, 3], [2, 3, 3, 32], [2, 3, 35, 8]]
    assert plan.max_kv == 40
    assert attention_plan([1], [0], group=1, head_dim=8, device="cpu").block_m == 16  # >= 16 rows for tl.dot
    assert tile_sizes(64, 4, 128, elem_bytes=4) == (64, 32)  # fp32 operands: half the rows and keys
    assert tile_sizes(64, 8, 256, elem_bytes=2) == (64, 32)
    assert tile_sizes(1, 32, 64, elem_bytes=2) == (32, 64)  # every head of the group fits one block
    assert choose_splits(programs=264, max_kv=100_000, device_programs=264) == 1  # the grid fills the device
    assert choose_splits(programs=8, max_kv=100_000, device_programs=264) == 32  # few rows: many splits
    assert choose_splits(programs=8, max_kv=3 * MIN_KEYS_PER_SPLIT, device_programs=264) == 3  # short contexts: few
    assert choose_splits(programs=8, max_kv=10, device_programs=264) == 1
    assert supports(80, 4) and supports(256, 1) and not supports(512, 16) and not supports(64, 12)


@pytest.fixture(scope="module")
def kernel_model(tiny_target):
    """The tiny target where the kernels run: a copy on CUDA when there is one, else the CPU model (interpreter)."""
    import copy

    return copy.deepcopy(tiny_target.model).to(DEVICE) if DEVICE == "cuda" else tiny_target.model


def test_engine_greedy_identity_with_triton_path(kernel_model):
    from draftheads.inference.engine import Engine, EngineConfig
    from draftheads.inference.proposers.eagle3 import Eagle3Proposer
    from draftheads.inference.sampling import SamplingParams
    from draftheads.inference.tree import TreeSpec
    from draftheads.testing import random_heads

    model = kernel_model
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37]]
    params = SamplingParams(max_new_tokens=8, stop_at_eos=False)
    proposer = Eagle3Proposer(random_heads(model)["eagle3"].to(model.device), model)
    triton_out = Engine(model, proposer=proposer, config=EngineConfig(use_triton=True),
                        tree=TreeSpec(depth=3, top_k=2, total_tokens=6)).generate(prompts, params)
    torch_out = Engine(model, config=EngineConfig(use_triton=False)).generate(prompts, params)
    assert [o.token_ids for o in triton_out] == [o.token_ids for o in torch_out]
    assert all(o.metrics.drafts > 0 for o in triton_out)


@pytest.mark.slow
def test_engine_prompt_longer_than_128_tokens_on_the_triton_path(kernel_model):
    from draftheads.inference.engine import Engine, EngineConfig
    from draftheads.inference.sampling import SamplingParams

    model = kernel_model
    prompt = [(7 * i) % 250 + 3 for i in range(140)]
    params = SamplingParams(max_new_tokens=3, stop_at_eos=False)
    got = Engine(model, config=EngineConfig(use_triton=True)).generate([prompt], params)
    want = Engine(model, config=EngineConfig(use_triton=False)).generate([prompt], params)
    assert got[0].token_ids == want[0].token_ids
