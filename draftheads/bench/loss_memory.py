"""Peak memory and time of the vocabulary loss, plain (materialised logits) vs fused/chunked.

Each measurement runs in a fresh subprocess; peak memory is the peak over the inputs already
allocated: ``torch.cuda.max_memory_allocated`` on CUDA; on CPU the resident-set high-water mark
(``VmHWM``, reset through ``/proc/self/clear_refs`` once the inputs exist) minus the resident set at
that moment. glibc's mmap threshold is pinned so freed tensors leave the resident set instead of being
reused silently (``ru_maxrss`` alone keeps the import-time peak and under-reads small losses).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

import torch

CASES = {49152: 576, 128256: 576}  # vocab -> hidden size (SmolLM2 vocab, Llama-3 vocab; hidden kept small so CPU runs finish)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_rss_peak() -> int:
    """Current resident bytes, after resetting the kernel's high-water mark to it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kb("VmRSS") * 1024
    except OSError:  # no procfs: the lifetime peak (over-states the baseline)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss_peak() -> int:
    try:
        return _status_kb("VmHWM") * 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _measure(kind: str, loss: str, vocab: int, hidden: int, tokens: int, device: str) -> dict:
    from draftheads.training.losses import (
        linear_cross_entropy,
        linear_kl,
        plain_linear_cross_entropy,
        plain_linear_kl,
    )

    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, device=device, requires_grad=True)
    w = torch.randn(vocab, hidden, device=device) * 0.02  # frozen lm_head
    labels = torch.randint(0, vocab, (tokens,), device=device)
    ht = torch.randn(tokens, hidden, device=device)
    impl = {"fused": "auto", "compiled": "compiled"}.get(kind)

    def fused():
        return linear_cross_entropy(h, w, labels, impl=impl) if loss == "ce" else linear_kl(h, w, ht, w, impl=impl)

    if kind == "compiled":  # compiled by a first call, not measured
        fused().backward()
        h.grad = None
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.max_memory_allocated()
    else:
        base = _reset_rss_peak()
    t0 = time.perf_counter()
    if kind == "plain":
        out = plain_linear_cross_entropy(h, w, labels) if loss == "ce" else plain_linear_kl(h, w, ht, w)
    else:
        out = fused()
    out.backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _rss_peak()
    return {"peak_mb": (peak - base) / 2**20, "time_s": time.perf_counter() - t0, "loss": float(out)}


def run(tokens: int = 4096, device: str | None = None, progress=print, cases: dict[int, int] = CASES) -> dict:
    """One row per ``cases`` entry (vocab -> hidden size)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    results: dict = {"tokens": tokens, "device": device, "impl": "liger" if device == "cuda" else "chunked", "vocab": {}}
    for vocab, hidden in cases.items():
        row = {"hidden": hidden}
        for loss in ("ce", "kl"):
            for kind in ("plain", "fused") + (("compiled",) if device == "cpu" else ()):
                args = json.dumps([kind, loss, vocab, hidden, tokens, device])
                code = f"import json; from draftheads.bench.loss_memory import _measure; print(json.dumps(_measure(*json.loads({args!r}))))"
                env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}  # large tensors: mmap'd, unmapped on free
                r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
                row[f"{loss}_{kind}"] = json.loads(r.stdout.strip().splitlines()[-1])
                progress(f"loss-memory V={vocab} {loss} {kind}: {row[f'{loss}_{kind}']['peak_mb']:.0f} MB")
            row[f"{loss}_ratio"] = row[f"{loss}_fused"]["peak_mb"] / max(row[f"{loss}_plain"]["peak_mb"], 1e-9)
        row["plain_mb"] = row["ce_plain"]["peak_mb"]
        row["fused_mb"] = row["ce_fused"]["peak_mb"]
        results["vocab"][str(vocab)] = row
    return results


def table(results: dict) -> str:
    lines = [
        f"loss memory, {results['tokens']} tokens, {results['device']} ({results['impl']} fused path)",
        "| vocab | hidden | loss | plain MB | fused MB | fused/plain | plain s | fused s | |loss diff| "
        "| compiled MB | compiled s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v, row in results["vocab"].items():
        for loss in ("ce", "kl"):
            p, f = row[f"{loss}_plain"], row[f"{loss}_fused"]
            c = row.get(f"{loss}_compiled")  # CPU only, timed after the call that compiled it
            lines.append(
                f"| {v} | {row['hidden']} | {loss} | {p['peak_mb']:.0f} | {f['peak_mb']:.0f} | "
                f"{row[f'{loss}_ratio']:.1%} | {p['time_s']:.2f} | {f['time_s']:.2f} | {abs(p['loss'] - f['loss']):.2e} | "
                + (f"{c['peak_mb']:.0f} | {c['time_s']:.2f} |" if c else "- | - |")
            )
    return "\n".join(lines)
