"""Fused paths against their reference on a device, for ``scripts/gpu_check.sh``: Liger's fused losses
against the chunked torch path on CPU, and DFlash's FlexAttention block mask (and its tiled variant) against
the dense SDPA mask, with a training step's time and peak memory on CUDA."""

from __future__ import annotations

import time

import torch


def rel(x, y) -> float:
    """Largest difference of ``x`` from ``y``, relative to ``y``'s largest entry."""
    return float((x - y).abs().max() / y.abs().max().clamp_min(1e-12))


def loss_parity(name: str, fn, n: int, hidden: int, v: int, device: str) -> dict:
    """``fn`` (a fused loss: ``cross_entropy`` takes labels, ``kl`` a teacher's states and weight) with
    ``impl="liger"`` on ``device`` against ``impl="chunked"`` on CPU: values and both gradients."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(n, hidden, generator=gen)
    w = torch.randn(v, hidden, generator=gen) * 0.05
    extra = (torch.randint(v, (n,), generator=gen),) if name == "cross_entropy" else (
        torch.randn(n, hidden, generator=gen), torch.randn(v, hidden, generator=gen) * 0.05)
    out = {}
    for where, impl in ((device, "liger"), ("cpu", "chunked")):
        hh, ww = h.clone().to(where).requires_grad_(), w.clone().to(where).requires_grad_()  # own grads
        loss = fn(hh, ww, *(e.to(where) for e in extra), impl=impl)
        loss.backward()
        out[impl] = (loss.detach().cpu(), hh.grad.cpu(), ww.grad.cpu())
    (a, ga, wa), (b, gb, wb) = out["liger"], out["chunked"]
    return {"liger": float(a), "chunked": float(b), "loss_rel": rel(a, b), "grad_h_rel": rel(ga, gb),
            "grad_w_rel": rel(wa, wb)}


def block_batch(rows: int, t: int, vocab: int, gen) -> dict:
    """Packed rows of two documents each, the loss on the second half of each document."""
    half = t // 2
    pos = torch.arange(half).repeat(rows, 2)
    docs = (torch.arange(t) >= half).long().repeat(rows, 1)
    loss_mask = (pos >= half // 2).long()
    return {"input_ids": torch.randint(vocab, (rows, t), generator=gen), "position_ids": pos, "doc_ids": docs,
            "loss_mask": loss_mask}


def flex_vs_sdpa(target_dir, device: str, small: bool) -> dict:
    """One DFlash batch with the FlexAttention and the tiled block masks against dense SDPA: loss and head
    gradients in float32 (``small``: tiny shapes and losses only, FlexAttention having no CPU backward),
    then on CUDA a bf16-autocast training step's time and peak memory for each."""
    from draftheads.training import DFlashModule

    rows, t, anchors, blk = (2, 64, 8, 4) if small else (4, 2048, 128, 8)
    torch.manual_seed(0)
    m = DFlashModule(target=str(target_dir), target_dtype="float32" if small else "bfloat16", block_size=blk,
                     anchors_per_row=anchors, num_layers=2, target_layer_ids=[1, 2], mask_token_id=1,
                     loss_impl="chunked" if small else "liger")
    m.configure_model()
    m = m.to(device).train()
    batch = {k: v.to(device) for k, v in block_batch(rows, t, m.info.vocab_size, torch.Generator().manual_seed(1)).items()}
    params = [p for p in m.head.parameters() if p.requires_grad]

    def step(attention, autocast, grads=True):
        m.hparams.attention = attention
        m.head.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast), torch.set_grad_enabled(grads):
            loss = m.compute_loss(batch)[0]
        if grads:
            loss.backward()
        return loss.detach().float(), [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                                       for p in params] if grads else []

    grads = not small
    (la, ga), (lb, gb), (lc, gc) = step("sdpa", False, grads), step("flex", False, grads), step("tiles", False, grads)
    r = {"shape": {"rows": rows, "tokens": t, "anchors_per_row": anchors, "block_size": blk},
         "loss_rel": rel(lb, la), "grad_rel": max((rel(b, a) for a, b in zip(ga, gb)), default=0.0),
         "tiles": {"loss_rel": rel(lc, la), "grad_rel": max((rel(c, a) for a, c in zip(ga, gc)), default=0.0)}}
    if device == "cuda" and not small:
        for name in ("sdpa", "tiles", "flex"):
            for _ in range(2):  # compiles the block mask's kernels at this shape
                step(name, True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            for _ in range(5):
                step(name, True)
            torch.cuda.synchronize()
            r.setdefault(name, {}).update(step_ms=(time.perf_counter() - t0) / 5 * 1e3,
                                          peak_gib=torch.cuda.max_memory_allocated() / 2**30)
    return r
