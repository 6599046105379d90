"""``draftheads eval``: acceptance and speedup per domain, plain and speculative decoding side by side.

Each prompt (each turn of a multi-turn prompt) runs once with plain decoding and once per speculative
*mode* (``auto``, or a tree option such as ``chain3``, vLLM's serving mode), through the timing
harness of :mod:`draftheads.inference.timing` (warm-up, shuffled order so that machine drift cancels,
re-measuring of physically impossible ratios). Later turns feed the target's own earlier (plain)
answers back. Per mode, domain and overall: tau, alpha per position, acceptance rate, drafts,
tokens/s, speedup (sum of plain wall time / sum of speculative wall time, and the median over prompts)
with 95 % confidence intervals; at T = 0 every speculative output is compared with the plain one.

Greedy identity: in fp32 the speculative output equals the plain one token for token. In bf16/fp16 a
K-token verify forward and a 1-token forward round differently, so where the target's two best tokens
are within rounding of each other the two runs may pick different ones. Each mismatch is classified at
its first differing token by the target's own logits there (:func:`classify_divergence`): a *near tie*
(the two tokens' logits within ``TIE_ULPS`` units in the last place of the target's dtype) or a *real
divergence*, which is a bug and fails the eval.
"""

from __future__ import annotations

import itertools
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftheads.inference.engine import Engine
from draftheads.inference.sampling import SamplingParams
from draftheads.inference.timing import SLACK, generation_run, interleaved, tokens_per_forward, warm_up
from draftheads.metrics import SpecMetrics, mean_ci95
from draftheads.prompts import Prompt, encode_chat
from draftheads.utils import atomic_write_json, atomic_write_text


@dataclass
class PromptResult:
    id: str
    domain: str
    plain_wall_s: float = 0.0
    spec_wall_s: float = 0.0
    plain_tokens: int = 0
    spec_tokens: int = 0
    mismatches: int = 0
    near_ties: int = 0  # mismatches whose first differing tokens are tied within the dtype's rounding
    flagged: int = 0  # turns whose speedup stayed above tokens per forward after re-measuring
    metrics: SpecMetrics = field(default_factory=SpecMetrics)

    @property
    def speedup(self) -> float:
        return self.plain_wall_s / self.spec_wall_s if self.spec_wall_s else float("nan")


def _progress(done: int, total: int, t0: float, label: str) -> None:
    el = time.perf_counter() - t0
    eta = el / done * (total - done) if done else 0.0
    bar = "#" * int(30 * done / max(total, 1))
    print(f"\r{label} [{bar:<30}] {done}/{total} elapsed {el:5.0f}s eta {eta:5.0f}s", end="", file=sys.stderr, flush=True)
    if done == total:
        print(file=sys.stderr)


def evaluate(target, proposer, modes: list[str], prompts: list[Prompt], params: SamplingParams, batch_size: int = 1,
             label: str = "eval", progress: bool = True) -> dict[str, list[PromptResult]]:
    """Run plain decoding and ``proposer`` in each mode (``auto``, a tree name or file) on ``prompts`` in
    batches; returns per-mode, per-prompt results (the plain timings are shared by all modes)."""
    from draftheads.inference.build import make_engine

    tok = target.tokenizer
    engines = {"plain": Engine(target.model, tok, None)}
    for mode in modes:
        engines[mode] = make_engine(target, proposer, mode)
    warm_up(engines.values(), tok("warm up", add_special_tokens=False).input_ids or [0])
    results = {m: {p.id: PromptResult(p.id, p.domain) for p in prompts} for m in modes}
    histories: dict[str, list[dict]] = {p.id: [] for p in prompts}
    total = sum(len(p.turns) for p in prompts)
    done, t0 = 0, time.perf_counter()
    seeded = lambda n: [SamplingParams(**{**params.__dict__, "seed": params.seed + i}) for i in range(n)]  # noqa: E731
    methods = {name: (lambda ids, e=e: generation_run(e, ids, seeded(len(ids)))) for name, e in engines.items()}
    for turn in range(max(len(p.turns) for p in prompts)):
        live = [p for p in prompts if turn < len(p.turns)]
        batches = [live[s: s + batch_size] for s in range(0, len(live), batch_size)]
        items = []
        for batch in batches:
            for p in batch:
                histories[p.id].append({"role": "user", "content": p.turns[turn]})
            items.append([encode_chat(tok, histories[p.id], name=target.info.name) for p in batch])

        first = done
        sizes = list(itertools.accumulate(len(b) for b in batches))
        timings = interleaved(methods, items, progress=(lambda k, first=first, sizes=sizes: _progress(
            first + sizes[k], total, t0, label)) if progress else None)
        done += len(live)
        for k, batch in enumerate(batches):
            plain_run = timings.runs["plain"][k]
            for mode in modes:
                spec_run = timings.runs[mode][k]
                for p, po, so in zip(batch, plain_run.outputs, spec_run.outputs):
                    r = results[mode][p.id]
                    r.plain_wall_s += plain_run.seconds / len(batch)
                    r.spec_wall_s += spec_run.seconds / len(batch)
                    r.plain_tokens += len(po.token_ids)
                    r.spec_tokens += len(so.token_ids)
                    r.flagged += int(k in timings.flagged.get(mode, []))
                    if params.greedy and po.token_ids != so.token_ids:
                        r.mismatches += 1
                        r.near_ties += classify_divergence(target.model, items[k][batch.index(p)], po.token_ids,
                                                           so.token_ids)["near_tie"]
                    r.metrics = r.metrics.merge(so.metrics)
            for p, po in zip(batch, plain_run.outputs):
                histories[p.id].append({"role": "assistant",
                                        "content": tok.decode(po.token_ids, skip_special_tokens=True)})
    return {m: [results[m][p.id] for p in prompts] for m in modes}


TIE_ULPS = 4
"""Two logits within this many units in the last place of the target's dtype are a near tie."""


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first token where ``a`` and ``b`` differ (the shorter length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@torch.no_grad()
def classify_divergence(model, prompt: list[int], a: list[int], b: list[int]) -> dict:
    """Where greedy outputs ``a`` and ``b`` of ``prompt`` first differ, and whether the target's logits
    there (one plain forward over the common prefix) tie the two tokens within ``TIE_ULPS`` ulps."""
    j = first_difference(a, b)
    if j >= min(len(a), len(b)):  # one output stops where the other goes on: not a choice between two tokens
        return {"at": j, "margin": float("inf"), "near_tie": False}
    ids = torch.tensor([list(prompt) + list(a[:j])], device=model.device)
    logits = model(ids).logits[0, -1]
    x, y = logits[a[j]].float().item(), logits[b[j]].float().item()
    ulp = torch.finfo(logits.dtype).eps * 2.0 ** math.floor(math.log2(max(abs(x), abs(y), 1e-30)))
    margin = abs(x - y)
    return {"at": j, "margin": margin, "near_tie": margin <= TIE_ULPS * ulp}


def summarize(results: list[PromptResult]) -> dict:
    m = SpecMetrics()
    for r in results:
        m = m.merge(r.metrics)
    plain_wall = sum(r.plain_wall_s for r in results)
    spec_wall = sum(r.spec_wall_s for r in results)
    taus = [r.metrics.tau for r in results if r.metrics.drafts]
    speedups = [r.speedup for r in results]
    tau_mean, tau_ci = mean_ci95(taus)
    sp_mean, sp_ci = mean_ci95(speedups)
    return {
        "n_prompts": len(results),
        "tau": m.tau,
        "tau_ci95": tau_ci,
        "tau_mean_over_prompts": tau_mean,
        "alpha": m.alpha,
        "acceptance_rate": m.acceptance_rate,
        "drafts": m.drafts,
        "steps": m.target_forwards,
        "draft_tokens": m.draft_tokens,
        "accepted": m.accepted,
        "tokens_per_s_plain": sum(r.plain_tokens for r in results) / plain_wall if plain_wall else 0.0,
        "tokens_per_s_spec": sum(r.spec_tokens for r in results) / spec_wall if spec_wall else 0.0,
        "speedup": plain_wall / spec_wall if spec_wall else float("nan"),
        "speedup_mean_over_prompts": sp_mean,
        "speedup_ci95": sp_ci,
        "speedup_median_over_prompts": statistics.median(speedups) if speedups else float("nan"),
        "tokens_per_forward": tokens_per_forward(m),
        "implausible_timings": sum(r.flagged for r in results),
        "greedy_mismatches": sum(r.mismatches for r in results),
        "near_ties": sum(r.near_ties for r in results),
        "real_divergences": sum(r.mismatches - r.near_ties for r in results),
    }


def report(results: dict[str, list[PromptResult]], meta: dict) -> dict:
    """``{mode: per-prompt results}`` -> JSON: per mode, overall and per domain."""
    modes = {}
    for mode, rs in results.items():
        domains = sorted({r.domain for r in rs})
        modes[mode] = {
            "overall": summarize(rs),
            "domains": {d: summarize([r for r in rs if r.domain == d]) for d in domains},
            "prompts": [{"id": r.id, "domain": r.domain, "tau": r.metrics.tau, "speedup": r.speedup,
                         "mismatches": r.mismatches, "near_ties": r.near_ties} for r in rs],
        }
    return {**meta, "modes": modes}


def markdown(res: dict) -> str:
    modes = res["modes"]
    k = max((len(v["alpha"]) for m in modes.values() for v in m["domains"].values()), default=0)
    head = "| mode | domain | prompts | τ (±95% CI) | " + " | ".join(f"α@{i + 1}" for i in range(k)) + \
        " | drafted steps | plain tok/s | spec tok/s | speedup | mismatches (near ties) |"
    lines = [f"`{res['command']}`", "", head, "|" + "---|" * (head.count("|") - 1)]
    for mode, m in modes.items():
        for name, v in list(m["domains"].items()) + [("**overall**", m["overall"])]:
            alphas = " | ".join([f"{a:.2f}" for a in v["alpha"]] + ["-"] * (k - len(v["alpha"])))
            lines.append(
                f"| {mode} | {name} | {v['n_prompts']} | {v['tau']:.2f} ± {v['tau_ci95']:.2f} | {alphas} | "
                f"{v['drafts']}/{v.get('steps', v['drafts'])} | {v['tokens_per_s_plain']:.1f} | {v['tokens_per_s_spec']:.1f} | {_speedup(v)} | "
                f"{v['greedy_mismatches']} ({v['near_ties']}) |"
            )
    return "\n".join(lines) + "\n"


def _speedup(v: dict) -> str:
    """The speedup, or a flag where some timings stayed above the physical bound after re-measuring."""
    if v.get("implausible_timings"):
        return f"{v['speedup']:.2f}x (disturbed: {v['implausible_timings']} turns above τ, re-run)"
    if v["speedup"] > SLACK * max(1.0, v["tokens_per_forward"]):
        return f"{v['speedup']:.2f}x (above its tokens-per-forward bound {v['tokens_per_forward']:.2f}: re-run)"
    return f"{v['speedup']:.2f}x"


def plots(res: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    modes = res["modes"]
    doms = sorted({d for m in modes.values() for d in m["domains"]})
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, m in modes.items():
        for d in doms:
            a = m["domains"][d]["alpha"]
            ax.plot(range(1, len(a) + 1), a, marker="o", label=f"{d} ({mode})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("α (accepted / drafts reaching it)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=6, ncol=2)
    ax.set_title("acceptance by position")
    files.append(out / "alpha_by_position.png")
    fig.tight_layout()
    fig.savefig(files[-1], dpi=120)
    plt.close(fig)
    width = 0.8 / max(len(modes), 1)
    for key, ci, ylabel, name in (("tau", "tau_ci95", "τ (mean accepted length)", "tau_by_domain.png"),
                                  ("speedup", "speedup_ci95", "speedup vs plain", "speedup_by_domain.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, (mode, m) in enumerate(modes.items()):
            vals = [m["domains"][d][key] for d in doms]
            errs = [0 if m["domains"][d][ci] != m["domains"][d][ci] else m["domains"][d][ci] for d in doms]
            ax.bar([x + i * width for x in range(len(doms))], vals, width, yerr=errs, capsize=3, label=mode)
        ax.set_xticks([x + width * (len(modes) - 1) / 2 for x in range(len(doms))], doms, rotation=30)
        if key == "speedup":
            ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        files.append(out / name)
        fig.tight_layout()
        fig.savefig(files[-1], dpi=120)
        plt.close(fig)
    return files


def machine() -> dict:
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "platform": platform.platform(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def write_results(res: dict, out: str | os.PathLike) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "results.json", res)
    atomic_write_text(out / "results.md", markdown(res))
    return [out / "results.json", out / "results.md", *plots(res, out)]

