"""``draftheads bench``: speed side by side in one run.

Parts (``--only``): ``verify`` (forward time for K = 1 .. 64 query tokens and the memory-bound check),
``proposers`` (tokens/s of plain decoding in our engine, HF ``generate``, HF prompt lookup, n-gram and
the given heads, on the same prompts), ``batch`` (speedup of each proposer vs plain decoding at batch
1 .. 16), ``memory`` (the loss memory table), ``datagen`` (data-generation throughput: batch-1 plain
decoding vs a static batch vs continuous batching, with and without feature capture, on real answers
that end at different lengths), ``ceiling`` (the engine's best case: a drafter that costs nothing, accepted
with a fixed probability per position, against plain decoding). Except in ``datagen``, every timed
configuration generates exactly ``max_new_tokens`` tokens per prompt (no early stop), alternating between
methods per prompt.

**One text for every mode** (``one_text``, the default of ``proposers`` and ``batch``): greedy
speculation emits plain decoding's text exactly in float32, but in reduced precision the target's
argmax flips between near-tied tokens with the shape of the verify forward, and from the first flip each
mode decodes a text of its own. One mode then falls into a repetition loop that a draft predicts almost
for free and another does not, and the comparison measures which text each got, not the mode. So plain
decoding's batch-1 text is decoded first, and every engine then verifies along it
(:class:`~draftheads.inference.verify.ReferenceVerifier`: the same forwards and projections, the text's
token emitted where the argmax differs, the number of such flips reported).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from draftheads.evaluation import first_difference
from draftheads.inference.cost import grid_key
from draftheads.inference.engine import Engine, EngineConfig
from draftheads.inference.sampling import SamplingParams
from draftheads.inference.timing import Run, generation_run, interleaved, tokens_per_forward, warm_up

PARTS = ("verify", "proposers", "batch", "memory", "datagen", "ceiling")


def memory_bound_check(model, curve: dict[int, float]) -> dict:
    """Weight bytes / measured copy bandwidth vs the measured 1-token forward time."""
    from draftheads.bench.kernels import copy_bandwidth

    device = next(model.parameters()).device
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = copy_bandwidth(device, 1 << 28)
    floor_ms = weight_bytes / (bw / 2) * 1000  # reading every weight once (copy bw counts read + write)
    return {"weight_mb": weight_bytes / 2**20, "copy_gbps": bw / 1e9, "weight_read_ms": floor_ms,
            "k1_ms": curve[min(curve)], "k1_over_weight_read": curve[min(curve)] / floor_ms}


def _hf_generate(model, ids, n, prompt_lookup: int | None = None):
    kw = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    x = torch.tensor([ids], device=model.device)
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=0, **kw)
    return out.shape[1] - len(ids)


def _config(cfg: EngineConfig | None, one_text: bool) -> EngineConfig | None:
    return dataclasses.replace(cfg or EngineConfig(), verifier="reference") if one_text else cfg


def _engines(target, proposers: dict, one_text: bool, plain: tuple[str, ...]) -> dict:
    """Engines by name: plain decoding's (``plain``) and one per proposer entry (name -> (proposer, tree
    mode, config)), verifying along one text when ``one_text`` (texts set by :func:`_follow`)."""
    from draftheads.inference.build import make_engine

    cfg = _config(None, one_text)
    engines = {name: Engine(target.model, target.tokenizer, None, config=cfg) for name in plain}
    engines.update({name: make_engine(target, p, tree, _config(c, one_text)) for name, (p, tree, c) in proposers.items()})
    return engines


def _follow(plain: Engine, engines, prompts: list[list[int]], params: SamplingParams) -> None:
    """Decode plain decoding's batch-1 text of every prompt with ``plain`` (before any text is set, it decodes
    its own argmax), for every engine with the reference verifier to follow."""
    texts = {p: plain.generate([list(p)], params)[0].token_ids for p in dict.fromkeys(map(tuple, prompts))}
    for e in engines:
        if e.verifier.name == "reference":
            e.verifier.texts = texts


def proposer_speeds(target, proposers: dict, prompts: list[list[int]], n: int, progress=print,
                    one_text: bool = True) -> dict:
    """Tokens/s per method on the same prompts at batch 1; ratio to our plain decode (pooled, and the
    median of per-prompt ratios with quartiles). ``proposers``: {name: (proposer, tree mode, config)};
    ``one_text``: every engine verifies along plain decoding's text (see the module docstring)."""
    model = target.model
    params = SamplingParams(max_new_tokens=n, stop_at_eos=False)
    # "plain (again)": a second plain engine, the A/A control: its ratio is the harness's noise floor
    engines = _engines(target, proposers, one_text, ("plain", "plain (again)"))
    warm_up(engines.values(), prompts[0])
    if one_text:
        progress("proposers: decoding plain decoding's text to follow")
        _follow(engines["plain"], engines.values(), prompts, params)
    _hf_generate(model, prompts[0][:8], 2)

    def hf(prompt_lookup):
        def run(ids):
            t0 = time.perf_counter()
            got = _hf_generate(model, ids, n, prompt_lookup=prompt_lookup)
            return Run(time.perf_counter() - t0, got)
        return run

    methods = {name: (lambda ids, e=e: generation_run(e, [ids], params)) for name, e in engines.items()}
    methods.update({"hf_generate": hf(None), "hf_prompt_lookup": hf(10)})
    t = interleaved(methods, prompts, progress=lambda i: progress(f"proposers: prompt {i + 1}/{len(prompts)}"))
    out = {}
    for m in methods:
        out[m] = {"tokens_per_s": t.rate(m), "ratio_vs_plain": t.rate(m) / t.rate("plain")}
        if m != "plain":
            r = t.ratio(m)
            out[m].update(ratio_median=r["median"], ratio_q25=r["q25"], ratio_q75=r["q75"], ratio_ci95=r["ci95"],
                          implausible=r["flagged"], above_bound=r["above_bound"])
        if m in engines and m != "plain":
            out[m].update(same_text(t.runs["plain"], t.runs[m]))
            if engines[m].verifier.name == "reference":
                out[m]["flips"] = engines[m].verifier.flips  # over every timed run of it
        if m in engines and engines[m].proposer is not None:
            agg = t.metrics(m)
            out[m].update(tau=agg.tau, alpha=agg.alpha, tokens_per_forward=tokens_per_forward(agg),
                          drafted_steps=agg.drafts, steps=agg.target_forwards)
            if engines[m].policy is not None:  # auto: the trees it chose, and its prediction against the outcome
                out[m]["auto"] = engines[m].policy.report().get(1)
                out[m]["auto"]["plain_engine_seconds_per_step"] = 1 / t.rate("plain")
    return out


def _step_seconds(a: dict) -> str:
    """An ``auto`` report's step times: a drafted step's draft and verify (against the verify predicted for
    the trees chosen), beside a plain step in the same engine and in the plain engine (absent in reports
    written before they were kept)."""
    if "verify_seconds_per_step" not in a:
        return ""
    ms = lambda x: f"{1000 * x:.0f} ms"  # noqa: E731
    out = (f"; a drafted step {ms(a['draft_seconds_per_step'] + a['verify_seconds_per_step'])} (draft "
           f"{ms(a['draft_seconds_per_step'])}, verify {ms(a['verify_seconds_per_step'])} against "
           f"{ms(a['predicted_verify_seconds_per_step'])} predicted)")
    plain = [f"{ms(a['believed_plain_seconds_per_step'])} as the cost model held it"] \
        if a.get("believed_plain_seconds_per_step") else []
    if a.get("plain_steps"):
        held = f", {a['held_steps']} held by the batch's gate" if a.get("held_steps") else ""
        plain.append(f"{ms(a['plain_seconds_per_step'])} in this engine ({a['plain_steps']} steps{held})")
    if a.get("plain_engine_seconds_per_step"):
        plain.append(f"{ms(a['plain_engine_seconds_per_step'])} in the plain engine")
    return out + (", a plain step " + ", ".join(plain) if plain else "")


def same_text(base: list[Run], runs: list[Run]) -> dict:
    """How far a method's outputs agree with plain decoding's, prompt by prompt: ``same_text`` prompts of
    ``prompts`` identical, and the mean share of each output before its first differing token. Greedy
    speculation is exact, but in reduced precision the target's argmax may flip between near-tied tokens
    with the shape of the verify forward, and from there each method decodes (and is timed on) its own
    text."""
    same, share = 0, 0.0
    for b, r in zip(base, runs):
        x, y = b.outputs[0].token_ids, r.outputs[0].token_ids
        same += x == y
        share += first_difference(x, y) / max(len(x), 1)
    return {"same_text": same, "prompts": len(base), "shared_prefix": share / max(len(base), 1)}


def ceiling(target, prompts: list[list[int]], n: int, chains=(3, 5), p: float = 0.8, progress=print) -> dict:
    """Plain decoding against chains of each length in ``chains`` drafted for free (random tokens) and
    accepted with probability ``p`` per position whatever they are (the synthetic verifier), at batch 1
    on the same prompts, interleaved. Its speedup over its τ is the most any head can get per token of
    τ on this machine, dtype and engine: what is left once drafting costs nothing."""
    from draftheads.inference.engine import EngineConfig
    from draftheads.inference.proposers.random_draft import RandomProposer

    model = target.model
    params = SamplingParams(max_new_tokens=n, stop_at_eos=False)
    vocab = model.get_output_embeddings().weight.shape[0]
    engines = {"plain": Engine(model, target.tokenizer, None)}
    for k in chains:
        cfg = EngineConfig(verifier="synthetic", synthetic_rates=(p,) * k)
        engines[f"chain{k}"] = Engine(model, target.tokenizer, RandomProposer(vocab), config=cfg, tree=f"chain{k}")
    warm_up(engines.values(), prompts[0])
    t = interleaved({name: (lambda ids, e=e: generation_run(e, [ids], params)) for name, e in engines.items()},
                    prompts, progress=lambda i: progress(f"ceiling: prompt {i + 1}/{len(prompts)}"))
    out = {"p": p}
    for k in chains:
        agg, speedup = t.metrics(f"chain{k}"), t.rate(f"chain{k}") / t.rate("plain")
        out[f"chain{k}"] = {"tau": agg.tau, "speedup": speedup, "step_cost": tokens_per_forward(agg) / speedup}
        progress(f"ceiling: chain{k} at p = {p}: tau {agg.tau:.2f}, {speedup:.2f}x")
    return out


def batch_sweep(target, proposers: dict, prompts: list[list[int]], n: int, batches=(1, 2, 4, 8, 16),
                repeats: int = 3, progress=print, one_text: bool = True) -> dict:
    """Speedup of each proposer over plain decoding at each batch size (same rows, interleaved, ``repeats``
    pairs; the pooled ratio with the median and quartiles of the pairs). ``proposers``: {name: (proposer,
    tree mode, config)}; one engine per proposer serves every batch size, as a server would (``auto``
    keeps its measurements per batch size). ``one_text``: every engine verifies along plain decoding's
    batch-1 text (see the module docstring)."""
    params = SamplingParams(max_new_tokens=n, stop_at_eos=False)
    engines = _engines(target, proposers, one_text, ("plain", "plain (again)"))  # "plain (again)": the A/A control
    plain = engines.pop("plain")
    warm_up([plain, *engines.values()], prompts[0])
    if one_text:
        _follow(plain, [plain, *engines.values()], prompts[: max(batches)], params)
    out: dict = {name: {} for name in engines}
    for b in batches:
        rows = [prompts[i % len(prompts)] for i in range(b)]
        methods = {"plain": lambda rows: generation_run(plain, rows, params)}
        methods.update({name: (lambda rows, e=e: generation_run(e, rows, params)) for name, e in engines.items()})
        before = {name: getattr(e.verifier, "flips", 0) for name, e in engines.items()}
        t = interleaved(methods, [rows] * repeats)
        for name, e in engines.items():
            r = t.ratio(name)
            out[name][b] = {k: r[k] for k in ("speedup", "median", "q25", "q75", "ci95", "pairs", "above_bound")}
            if e.verifier.name == "reference":
                out[name][b]["flips"] = e.verifier.flips - before[name]
            if e.policy is not None and (a := e.policy.report().get(grid_key(b))):
                out[name][b]["auto"] = a  # this batch size's steps so far (rows finishing leave smaller ones)
                a["plain_engine_seconds_per_step"] = b / t.rate("plain")
            progress(f"batch sweep: {name} batch {b}: {r['speedup']:.2f}x, median {r['median']:.2f}x "
                     f"(95% CI {r['ci95'][0]:.2f}-{r['ci95'][1]:.2f}, {r['pairs']} pairs)")
    return out


def datagen(target, prompts: list[list[int]], n: int, batch: int = 64, single: int = 4,
            capture=(2, 15, 27, 30), progress=print) -> dict:
    """Tokens/s of answering ``prompts`` (answers stop at end of turn, at most ``n`` tokens): one at a time,
    as static batches of ``batch`` (no refill), and with continuous batching (with and without capturing
    hidden states ``capture``). Ratios are to the batch-1 rate measured in the same run."""
    from draftheads.datagen.batching import ContinuousBatcher, Conversation

    model = target.model
    engine = Engine(model, target.tokenizer, None)
    params = SamplingParams(max_new_tokens=n)
    capture = tuple(i for i in capture if i <= target.info.num_layers)
    engine.generate([prompts[0][:8]], SamplingParams(max_new_tokens=2))
    res = {"batch": batch, "prompts": len(prompts), "max_new_tokens": n, "dtype": str(target.info.dtype)}

    def timed(name, fn):
        t0 = time.perf_counter()
        tokens = fn()
        dt = time.perf_counter() - t0
        res[name] = {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt}
        progress(f"datagen: {name}: {tokens} tokens in {dt:.1f} s = {tokens / dt:.1f} tok/s")

    timed("batch1", lambda: sum(len(engine.generate([p], params)[0].token_ids) for p in prompts[:single]))
    timed("static", lambda: sum(len(o.token_ids) for s in range(0, len(prompts), batch)
                                for o in engine.generate(prompts[s: s + batch], params)))
    for name, layers in (("continuous", ()), ("continuous_features", capture)):
        b = ContinuousBatcher(engine, batch, capture=layers)
        timed(name, lambda b=b: sum(len(f.answers[0]) for f in b.run(
            Conversation(i, [p], params) for i, p in enumerate(prompts))))
    base = res["batch1"]["tokens_per_s"]
    for k in ("static", "continuous", "continuous_features"):
        res[k]["ratio_vs_batch1"] = res[k]["tokens_per_s"] / base
    return res


def tables(res: dict) -> str:
    dtype = f", {res['dtype']}" if "dtype" in res else ""
    lines = [f"`{res['command']}` ({res['date']}, {res['machine']['platform']}, {res['machine']['threads']} threads"
             f"{dtype})", ""]
    if "verify_curve" in res:
        lines += ["verify cost (one forward, K query tokens after a 256-token prefix)", "",
                  "| K | ms | x K=1 |", "|---|---|---|"]
        base = res["verify_curve"][min(res["verify_curve"], key=int)]
        lines += [f"| {k} | {v:.1f} | {v / base:.2f} |" for k, v in res["verify_curve"].items()]
        mb = res["memory_bound"]
        lines += ["", f"weights {mb['weight_mb']:.0f} MB, copy bandwidth {mb['copy_gbps']:.1f} GB/s: reading the weights "
                      f"takes {mb['weight_read_ms']:.1f} ms; the 1-token forward takes {mb['k1_ms']:.1f} ms "
                      f"({mb['k1_over_weight_read']:.2f}x)", ""]
    if "proposers" in res:
        lines += ["| method | tokens/s | vs plain (pooled) | per-prompt median (quartiles) | τ | drafted steps | "
                  "step cost (x plain step) | text as plain's |", "|---|---|---|---|---|---|---|---|"]
        for m, v in res["proposers"].items():
            tau = f"{v['tau']:.2f}" if "tau" in v else "-"
            med = (f"{v['ratio_median']:.2f}x (quartiles {v['ratio_q25']:.2f}-{v['ratio_q75']:.2f}, 95% CI "
                   f"{v['ratio_ci95'][0]:.2f}-{v['ratio_ci95'][1]:.2f})" if "ratio_median" in v else "-")
            if v.get("implausible"):
                med += f", {v['implausible']} prompts disturbed (above τ), re-run"
            if v.get("above_bound"):
                med += ", ABOVE the tokens-per-forward bound: noise or a disturbed run, re-run"
            drafted = f"{v['drafted_steps']}/{v['steps']}" if "steps" in v else "-"
            cost = f"{v['tokens_per_forward'] / v['ratio_vs_plain']:.2f}" if "tokens_per_forward" in v else "-"
            text = (f"{v['same_text']}/{v['prompts']} same, {100 * v['shared_prefix']:.0f} % before the first "
                    "difference" if "same_text" in v else "-")
            if "flips" in v:
                text += f", {v['flips']} argmax flips followed"
            lines.append(f"| {m} | {v['tokens_per_s']:.1f} | {v['ratio_vs_plain']:.2f}x | {med} | {tau} | {drafted} "
                         f"| {cost} | {text} |")
        lines.append("")
        if any("flips" in v for v in res["proposers"].values()):
            lines += ["Every engine verified along plain decoding's text (the same forwards and projections; where "
                      "the target's argmax in a mode's verify shape differs from that text's token, a near tie in "
                      "reduced precision, the text's token is emitted and counted as a flip), so every mode is timed "
                      "on one text.", ""]
        if any(v.get("same_text", 0) < v.get("prompts", 0) for v in res["proposers"].values()):
            lines += ["Some methods decoded texts that differ from plain decoding's: in reduced precision the "
                      "target's argmax can flip between near-tied tokens with the shape of the verify forward, so "
                      "each such row is timed on its own text and its τ partly reflects how easy that text is. In "
                      "float32 the outputs are identical.", ""]
        for m, v in res["proposers"].items():
            if a := v.get("auto"):
                lines.append(f"{m}: {a['tree_tokens_per_step']:.1f} tokens verified per drafted step (root "
                             f"included); predicted {a['predicted_tokens_per_step']:.2f} tokens per drafted step, "
                             f"measured {a['measured_tokens_per_step']:.2f}{_step_seconds(a)}")
        lines.append("")
    if "batch_sweep" in res:
        bs = sorted({int(b) for v in res["batch_sweep"].values() for b in v})
        lines += ["speedup over plain: pooled, then the median of the interleaved pairs with its 95 % confidence "
                  "interval", "", "| proposer | " + " | ".join(f"batch {b}" for b in bs) + " |",
                  "|---" * (len(bs) + 1) + "|"]
        for name, v in res["batch_sweep"].items():
            v = {int(b): cell for b, cell in v.items()}  # the batch sizes are strings once written as JSON
            lines.append(f"| {name} | " + " | ".join(_sweep_cell(v[b]) if b in v else "-" for b in bs) + " |")
        lines.append("")
        autos = [f"{name}, steps of batch {b}: {a['drafted']} of {a['steps']} drafted, {a['tree_tokens_per_step']:.1f} "
                 f"tokens verified per drafted step (roots included); predicted {a['predicted_tokens_per_step']:.2f} "
                 f"tokens per drafted step, measured {a['measured_tokens_per_step']:.2f}{_step_seconds(a)}"
                 for name, v in res["batch_sweep"].items() for b, cell in v.items() if (a := cell.get("auto"))]
        if autos:
            lines += [*autos, ""]
    if "datagen" in res:
        d = res["datagen"]
        lines += [f"data generation, {d['prompts']} prompts, answers up to {d['max_new_tokens']} tokens (stop at end of "
                  f"turn), {d['dtype']}", "", "| mode | tokens | tokens/s | vs batch 1 |", "|---|---|---|---|"]
        for k, label in (("batch1", "batch 1"), ("static", f"static batch {d['batch']} (no refill)"),
                         ("continuous", f"continuous batch {d['batch']}"),
                         ("continuous_features", f"continuous batch {d['batch']} + features")):
            v = d[k]
            lines.append(f"| {label} | {v['tokens']} | {v['tokens_per_s']:.1f} | {v.get('ratio_vs_batch1', 1.0):.1f}x |")
        lines.append("")
    if "ceiling" in res:
        c = res["ceiling"]
        lines += [f"the engine's best case: chains drafted for free, accepted with p = {c['p']} per position "
                  "(synthetic verifier), batch 1", "", "| chain | τ | speedup | step cost (x plain step) |",
                  "|---|---|---|---|"]
        lines += [f"| {k} | {v['tau']:.2f} | {v['speedup']:.2f}x | {v['step_cost']:.2f} |"
                  for k, v in c.items() if k != "p"]
        lines.append("")
    if "loss_memory" in res:
        lines += ["| vocab | loss | plain MB | fused MB | fused/plain |", "|---|---|---|---|---|"]
        for v, row in res["loss_memory"].items():
            for loss in ("ce", "kl"):
                p, f = row[f"{loss}_plain"]["peak_mb"], row[f"{loss}_fused"]["peak_mb"]
                lines.append(f"| {v} | {loss} | {p:.0f} | {f:.0f} | {f / p:.1%} |")
    return "\n".join(lines) + "\n"


def _sweep_cell(v: dict) -> str:
    lo, hi = v["ci95"]
    flag = ", ABOVE its τ bound: re-run" if v.get("above_bound") else ""
    flag += f", {v['flips']} argmax flips followed" if v.get("flips") else ""
    return f"{v['speedup']:.2f}x (median {v['median']:.2f}x, CI {lo:.2f}-{hi:.2f}, {v['pairs']} pairs{flag})"


def plots(res: dict, out) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    if "verify_curve" in res:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ks = sorted(res["verify_curve"], key=int)
        ax.plot([int(k) for k in ks], [res["verify_curve"][k] for k in ks], marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("query tokens in one forward")
        ax.set_ylabel("ms")
        ax.set_title("verify cost")
        fig.tight_layout()
        files.append(out / "verify_curve.png")
        fig.savefig(files[-1], dpi=120)
        plt.close(fig)
    if "batch_sweep" in res:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for name, v in res["batch_sweep"].items():
            bs = sorted(v, key=int)
            ax.plot([int(b) for b in bs], [v[b]["speedup"] for b in bs], marker="o", label=name)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("speedup vs plain")
        ax.legend(fontsize=8)
        fig.tight_layout()
        files.append(out / "batch_sweep.png")
        fig.savefig(files[-1], dpi=120)
        plt.close(fig)
    return files
