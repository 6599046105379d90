"""Kernel and engine timings for ``scripts/gpu_check.sh``.

* paged tree attention: Triton kernel vs the torch reference path (gather + SDPA), and the kernel's
  achieved bandwidth (bytes of K/V and Q/O it must touch / time) over a measured device-to-device copy;
* the engine end to end on a random-weight target with synthetic acceptance: plain vs speculative
  tokens/s per batch size.
"""

from __future__ import annotations

import time

import torch

from draftheads.inference.tree import ancestor_mask, chain_parents


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timeit(fn, device, repeats: int = 10) -> float:
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / repeats


def copy_bandwidth(device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    x = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    y = torch.empty_like(x)
    t = timeit(lambda: y.copy_(x), device, repeats=5)
    return 2 * x.numel() * x.element_size() / t


def attention_case(batch: int, tree: int, context: int, heads=32, kv_heads=8, dim=128, dtype=torch.bfloat16,
                   device="cuda", block_size=16):
    """Launcher arguments for ``batch`` rows, each a context of ``context`` tokens and a ``tree``-token tree."""
    from draftheads.kernels.tree_attention import ancestor_words

    device = torch.device(device)
    per_row = -(-(context + tree) // block_size)
    nblocks = batch * per_row
    k = torch.randn(nblocks, block_size, kv_heads, dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    perm = torch.randperm(nblocks, device=device).to(torch.int32)
    tables = perm.view(batch, per_row)
    parents = chain_parents(tree - 1) if tree <= 2 else [-1] + [max(0, (i - 1) // 2) for i in range(1, tree)]
    mask = ancestor_mask(parents)
    q = torch.randn(batch * tree, heads, dim, dtype=dtype, device=device)
    token_row = torch.arange(batch, device=device, dtype=torch.int32).repeat_interleave(tree)
    anc, limit = ancestor_words([mask] * batch, [context] * batch, device)
    prefix = torch.full((batch,), context, dtype=torch.int32, device=device)
    return (q, k, v, token_row, anc, limit, prefix, tables, dim**-0.5)


def torch_path(args):
    """The engine's torch path on the same data: per row gather + SDPA with an additive mask."""
    import torch.nn.functional as F

    q, k, v, token_row, anc, limit, prefix, tables, scale = args
    bs = k.shape[1]
    rows = prefix.numel()
    tree = q.shape[0] // rows
    outs = []
    for r in range(rows):
        total = int(prefix[r]) + tree
        pos = torch.arange(total, device=q.device)
        blocks = tables[r][pos // bs].long()
        kk = k[blocks, pos % bs].transpose(0, 1)[None]
        vv = v[blocks, pos % bs].transpose(0, 1)[None]
        qq = q[r * tree:(r + 1) * tree].transpose(0, 1)[None]
        mask = torch.zeros(tree, total, dtype=q.dtype, device=q.device)
        outs.append(F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True))
    return outs


def attention_bytes(args) -> int:
    q, k, v, token_row, anc, limit, prefix, tables, scale = args
    kv_heads, dim, el = k.shape[2], k.shape[3], k.element_size()
    keys = int(prefix.sum()) + q.shape[0]
    return 2 * keys * kv_heads * dim * el + 2 * q.numel() * el  # K and V read once per row, Q read, O written


def bench_attention(device="cuda", batches=(1, 8, 32), trees=(16, 64), contexts=(1024, 8192), heads=32, kv_heads=8,
                    dim=128, dtype=torch.bfloat16, repeats=10, progress=print) -> dict:
    from draftheads.kernels.tree_attention import attention_plan, paged_tree_attention_fwd

    device = torch.device(device)
    bw = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 24)
    rows = []
    for b in batches:
        for t in trees:
            for c in contexts:
                args = attention_case(b, t, c, heads, kv_heads, dim, dtype, device)
                plan = attention_plan([t] * b, [c] * b, heads // kv_heads, dim, device, args[0].element_size())
                tk = timeit(lambda: paged_tree_attention_fwd(*args, plan=plan), device, repeats)  # noqa: B023 (called at once)
                tt = timeit(lambda: torch_path(args), device, max(1, repeats // 2))  # noqa: B023
                achieved = attention_bytes(args) / tk
                row = {"batch": b, "tree": t, "context": c, "triton_ms": tk * 1e3, "torch_ms": tt * 1e3,
                       "speedup_vs_torch": tt / tk, "achieved_gbps": achieved / 1e9,
                       "fraction_of_copy_bw": achieved / bw}
                rows.append(row)
                progress(f"attention b={b} tree={t} ctx={c}: triton {tk * 1e3:.3f} ms, torch {tt * 1e3:.3f} ms, "
                         f"{achieved / bw:.0%} of copy bandwidth")
    return {"copy_gbps": bw / 1e9, "rows": rows}


def bench_engine(model, batches=(1, 8, 32), rates=(0.8, 0.6, 0.4), prompt_len=128, new_tokens=64,
                 progress=print) -> dict:
    """Plain vs speculative (synthetic acceptance) tokens/s of the engine per batch size."""
    from draftheads.inference.engine import Engine, EngineConfig
    from draftheads.inference.proposers.random_draft import RandomProposer
    from draftheads.inference.sampling import SamplingParams
    from draftheads.inference.timing import generation_run, interleaved, warm_up

    vocab = model.get_output_embeddings().weight.shape[0]
    params = SamplingParams(max_new_tokens=new_tokens, stop_at_eos=False)
    synthetic = EngineConfig(verifier="synthetic", synthetic_rates=tuple(rates))
    engines = {"plain": Engine(model), "spec": Engine(model, proposer=RandomProposer(vocab), config=synthetic,
                                                      tree=f"chain{len(rates)}")}
    out = {}
    for b in batches:
        prompts = [torch.randint(vocab, (prompt_len,)).tolist() for _ in range(b)]
        warm_up(engines.values(), prompts[0])
        t = interleaved({n: (lambda rows, e=e: generation_run(e, rows, params)) for n, e in engines.items()},
                        [prompts] * 2)
        _sync(next(model.parameters()).device)
        res = {"plain_tok_s": t.rate("plain"), "spec_tok_s": t.rate("spec"), "tau": t.metrics("spec").tau}
        res["speedup"] = res["spec_tok_s"] / res["plain_tok_s"]
        out[b] = res
        progress(f"engine batch {b}: plain {res['plain_tok_s']:.1f} tok/s, spec {res['spec_tok_s']:.1f} tok/s "
                 f"(tau {res['tau']:.2f}), {res['speedup']:.2f}x")
    return out
