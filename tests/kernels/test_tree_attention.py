import pytest
import torch

from draftheads.inference.tree import ancestor_mask
from draftheads.kernels.tree_attention import (
    ancestor_words,
    paged_tree_attention_fwd,
    paged_tree_attention_ref,
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_matches_reference_odd_shapes(dtype):
    # 3 rows, trees of 1/7/13 tokens, block size 16, contexts 37 / 0 / 20
    rows = [(37, _tree(1, 0)), (0, _tree(7, 1)), (20, _tree(13, 2))]
    args = _case(rows, heads=4, kv_heads=2, dim=64, dtype=dtype)
    got = paged_tree_attention_fwd(*args)
    want = paged_tree_attention_ref(*args)
    err = (got.float() - want.float()).abs()
    bad = (err > TOL[dtype] * (1 + want.float().abs())).nonzero()
    assert not len(bad), f"mismatch at (token, head, dim) {bad[:8].tolist()}, max err {err.max().item():.3e}"


def test_kernel_large_tree_and_head_dim_128():
    rows = [(5, _tree(70, 3))]  # ancestor bits beyond 64 use the second word
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
        out[i] = torch.einsum("hs,shd->hd", s.masked_fill(~allowed[i][None], float("-inf")).softmax(-1), vv)
    return out


@pytest.mark.parametrize("prompt", [129, pytest.param(300, marks=pytest.mark.slow)])
def test_prefill_longer_than_the_tree_bits_is_causal(prompt):
    """A prefill is a chain of any length: each token sees the prefix and the chain up to itself (a
    prompt over 128 tokens used to raise in the ancestor-bit packing)."""
    rows = [(3, [-1] + list(range(prompt - 1))), (0, _tree(9, 4))]
    args = _case(rows, heads=2, kv_heads=1, dim=16, dtype=torch.float32)
    got = paged_tree_attention_fwd(*args)
    want = paged_tree_attention_ref(*args)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    causal = torch.zeros(prompt, 3 + prompt, dtype=torch.bool)
    for i in range(prompt):
        causal[i, : 3 + i + 1] = True
    torch.testing.assert_close(want[:prompt].float(), _dense(args, causal), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="at most 128"):  # a real tree over the bit budget still refuses
        ancestor_words([ancestor_mask(_tree(130, 5))], [0], DEVICE)


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
    pos = torch.arange(6)
    kk, vv = k[bt[0][pos // 16].long(), pos % 16], v[bt[0][pos // 16].long(), pos % 16]
    allowed = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 1]], dtype=torch.bool)
    s = torch.einsum("thd,shd->ths", q, kk) * scale
    s = s.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
    torch.testing.assert_close(want, torch.einsum("ths,shd->thd", s, vv), atol=1e-5, rtol=1e-5)


def test_engine_greedy_identity_with_triton_path(tiny_target):
    from draftheads.inference.engine import Engine, EngineConfig
    from draftheads.inference.proposers.eagle3 import Eagle3Proposer
    from draftheads.inference.sampling import SamplingParams
    from draftheads.inference.tree import TreeSpec
    from draftheads.testing import random_heads

    model = tiny_target.model
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37]]
    params = SamplingParams(max_new_tokens=8, stop_at_eos=False)
    proposer = Eagle3Proposer(random_heads(model)["eagle3"], model)
    triton_out = Engine(model, proposer=proposer, config=EngineConfig(use_triton=True),
                        tree=TreeSpec(depth=3, top_k=2, total_tokens=6)).generate(prompts, params)
    torch_out = Engine(model, config=EngineConfig(use_triton=False)).generate(prompts, params)
    assert [o.token_ids for o in triton_out] == [o.token_ids for o in torch_out]
    assert all(o.metrics.drafts > 0 for o in triton_out)


@pytest.mark.slow
def test_engine_prompt_longer_than_128_tokens_on_the_triton_path(tiny_target):
    from draftheads.inference.engine import Engine, EngineConfig
    from draftheads.inference.sampling import SamplingParams

    model = tiny_target.model
    prompt = [(7 * i) % 250 + 3 for i in range(140)]
    params = SamplingParams(max_new_tokens=3, stop_at_eos=False)
    got = Engine(model, config=EngineConfig(use_triton=True)).generate([prompt], params)
    want = Engine(model, config=EngineConfig(use_triton=False)).generate([prompt], params)
    assert got[0].token_ids == want[0].token_ids
