"""The serve check (``draftheads serve-check``, ``make vllm-check``, a recipe's ``serve`` stage): exported
heads served by vLLM itself, compared with this engine.

For each format: export the head, run vLLM (in its own environment, through ``vllm_run.py`` beside this
file) greedy on the eval prompts with and without the head, check the text is identical, read vLLM's
speculative-decoding counters (τ, α per position), and run this engine in chain mode with the same K on the
same prompt ids. Both engines are also timed at batch 1: plain, with the head (vLLM: the exported chain;
ours: the better of chain K and the small dynamic tree).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from draftheads.datagen.backends import last_error
from draftheads.errors import DraftheadsError
from draftheads.evaluation import machine
from draftheads.export.vllm import EXPORTS, export_head, vllm_loader_extra
from draftheads.heads import load_head
from draftheads.inference.build import make_proposer
from draftheads.inference.engine import Engine
from draftheads.inference.sampling import SamplingParams
from draftheads.inference.timing import generation_run, interleaved, warm_up
from draftheads.prompts import encode_chat, load_prompts
from draftheads.targets import resolve_target, vllm_target_dir
from draftheads.utils import atomic_write_json, atomic_write_text, shown_from


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_vllm(python: str, target: Path, prompts: Path, n: int, out: Path, fmt: str | None = None,
             draft: Path | None = None, k: int = 3) -> dict:
    cmd = [python, str(Path(__file__).with_name("vllm_run.py")), "--target", str(target), "--prompts", str(prompts),
           "--max-tokens", str(n), "--out", str(out)]
    if fmt:
        cmd += ["--method", EXPORTS[fmt].method, "--draft", str(draft), "--k", str(k)]
        extra = vllm_loader_extra(fmt, json.loads((Path(draft) / "config.json").read_text()))
        if extra:
            cmd += ["--loader-extra", json.dumps(extra)]
    # the same thread count as our engine (vLLM's CPU backend would otherwise keep one core for itself)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": str(torch.get_num_threads()), **os.environ}
    if v2_interpreted(fmt):
        env.update(V2_ON_CPU_ENV, PYTHONPATH=os.pathsep.join(filter(None, [str(V2_ON_CPU_PATH), env.get("PYTHONPATH")])))
    say(f"vllm: {fmt or 'plain'} ...")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0 and "Compiling model again due to a load failure" in proc.stdout:
        # vLLM 0.32's torch.compile cache can fail to reload an entry and then crash recompiling: once more without it
        say(f"vllm: {fmt or 'plain'}: compile-cache failure, retrying with VLLM_DISABLE_COMPILE_CACHE=1")
        env["VLLM_DISABLE_COMPILE_CACHE"] = "1"
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        log = out.with_suffix(".log")
        log.write_text(proc.stdout)
        raise DraftheadsError(f"vLLM run for {fmt or 'plain'} failed (rc {proc.returncode}): "
                              f"{last_error(proc.stdout) or 'no exception line'}; its output is in {log}")
    say(f"vllm: {fmt or 'plain'} done in {time.perf_counter() - t0:.0f} s")
    return json.loads(out.read_text())


V2_ON_CPU_PATH = Path(__file__).with_name("vllm_v2_cpu")
"""Holds the ``sitecustomize`` that names Triton's interpreter as the Triton CPU backend vLLM's V2 runner needs."""
V2_ON_CPU_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1", "TRITON_INTERPRET": "1", "DRAFTHEADS_TRITON_INTERPRETER_BACKEND": "1"}
"""Environment of a vLLM run of a V2-only format on CPU: the V2 runner, its Triton kernels interpreted (slowly:
such a row's vLLM timings say nothing about vLLM's speed)."""


def v2_interpreted(fmt: str | None) -> bool:
    """Whether vLLM runs ``fmt`` on its V2 model runner with Triton interpreted: a V2-only format, no CUDA."""
    return bool(fmt) and EXPORTS[fmt].model_runner_v2 and not torch.cuda.is_available()


TAU_TOLERANCE = 0.05
"""The most vLLM's tau may differ from ours, relative, in chain mode with the same K (the check fails beyond)."""
QUICK_MINUTES = 2
"""Training time of a head this check trains itself (a format check: a weak head shows as well as a good
one that vLLM loads and runs the export as our engine does)."""


def default_head(kind: str, out: Path) -> Path:
    """The head a format is checked with when none is given: the shipped reference head of that family,
    else the demo head (``train-head fit --config configs/smollm2-<family>-demo.yaml``), else one trained
    here for QUICK_MINUTES on a small distilled set (under OUT/heads/)."""
    from draftheads.heads.base import SHIPPED_HEADS, shipped_head_path

    for name in SHIPPED_HEADS:
        path = shipped_head_path(name)
        if (path / "model.safetensors").is_file() and json.loads((path / "config.json").read_text())["head_type"] == kind:
            return path
    demo = Path(f"runs/smollm2-{kind}-demo/head")
    if demo.is_dir():
        return demo
    return quick_head(kind, out / "heads")


def quick_head(kind: str, root: Path) -> Path:
    from draftheads.training.cli import config_under, save_config

    head = root / kind / "head"
    if head.is_dir():
        return head
    bin_dir = Path(sys.executable).parent
    features, data = root / "features", root / "data.jsonl"
    if not data.is_file():
        say(f"training a quick {kind} head: distilling 2 bundled train prompts per domain first")
        _run([str(bin_dir / "draftheads"), "distill", "--prompts", "bundled:train", "--limit-per-domain", "2",
              "--max-new-tokens", "96", "--features", "eagle3", "--feature-dir", str(features), "--max-seq-len", "512",
              "--val-fraction", "0.2", "--out", str(data)])
    base = f"configs/smollm2-{kind}-demo.yaml"
    cfg = config_under(base, root / kind, features,
                       trainer={"max_time": f"00:00:{QUICK_MINUTES:02d}:00", "logger": False, "callbacks": [],
                                "enable_checkpointing": False})
    path = save_config(cfg, root / kind / "train.yaml", f"{base} by the serve check")
    say(f"training a quick {kind} head ({QUICK_MINUTES} min): train-head fit --config {path}")
    _run([str(bin_dir / "train-head"), "fit", "--config", str(path)])
    return head


def _run(cmd: list[str]) -> None:
    rc = subprocess.call(cmd)
    if rc != 0:
        raise DraftheadsError(f"`{' '.join(cmd)}` failed (exit {rc}); see its output above")


def vllm_acceptance(counters: dict, k: int) -> tuple[float, list[float]]:
    """tau = 1 + accepted / drafts and per-position acceptance from vLLM's counters."""
    drafts = counters.get("num_drafts", 0)
    if not drafts:
        return 1.0, [0.0] * k
    per_pos = counters.get("num_accepted_tokens_per_pos", [0] * k)
    return 1.0 + counters["num_accepted_tokens"] / drafts, [a / drafts for a in per_pos]


def run_ours(target, proposer, trees: list[str], prompts: list[list[int]], n: int) -> dict[str, dict]:
    """Plain decoding and ``proposer`` with each tree on ``prompts``, interleaved by the timing harness."""
    engines = {"plain": Engine(target.model, target.tokenizer, None)}
    engines.update({t: Engine(target.model, target.tokenizer, proposer, tree=t) for t in trees} if proposer else {})
    warm_up(engines.values(), prompts[0])
    params = SamplingParams(max_new_tokens=n)
    t = interleaved({name: (lambda ids, e=e: generation_run(e, [ids], params)) for name, e in engines.items()}, prompts)
    return {name: {"metrics": t.metrics(name), "token_ids": [r.outputs[0].token_ids for r in t.runs[name]],
                   "tok_s": t.rate(name)} for name in engines}


def tok_s(run: dict) -> float:
    return sum(len(r["token_ids"]) for r in run["rows"]) / sum(r["wall_s"] for r in run["rows"])


def serve_check(target, target_spec: str, heads: dict[str, str | None], formats: list[str], k: int = 3,
                max_tokens: int = 64,
                prompts_spec: str = "bundled:eval", limit_per_domain: int = 1, vllm_python: str = ".venv-vllm/bin/python",
                out: str | Path = "runs/vllm-check", update: bool = False, command: str = "") -> int:
    """Serve each of ``formats`` (its head from ``heads``, by family; default: see :func:`default_head`) in vLLM
    and compare it with this engine on ``target`` (loaded from ``target_spec``, which vLLM loads too); writes
    ``out/results.{json,md}``. Returns 1 when a format fails (:func:`failures`), else 0."""
    out = Path(out)
    heads = dict(heads)
    unknown = [f for f in formats if f not in EXPORTS]
    if unknown:
        raise DraftheadsError(f"--formats {unknown} unknown: use some of {', '.join(EXPORTS)}")
    if not Path(vllm_python).is_file():
        raise DraftheadsError(f"--vllm-python {vllm_python}: vLLM is not installed there (`make vllm-check` builds "
                              ".venv-vllm)")
    for fmt in formats:
        kind = EXPORTS[fmt].head_type
        if heads.get(kind) is None:
            heads[kind] = str(default_head(kind, out))
        if not os.path.isdir(heads[kind]):
            raise DraftheadsError(f"{fmt} needs a {kind} head: --{kind} {heads[kind]!r} is not a directory "
                                  "(train one with train-head, or drop it from --formats)")
    (out / "vllm").mkdir(parents=True, exist_ok=True)

    tdir = vllm_target_dir(Path(resolve_target(target_spec)), out / "target")
    tok = target.tokenizer
    prompts = load_prompts(prompts_spec, limit_per_domain=limit_per_domain)
    ids = [encode_chat(tok, [{"role": "user", "content": q.turns[0]}], name=target_spec) for q in prompts]
    prompt_file = out / "prompts.json"
    atomic_write_json(prompt_file, ids)

    vplain = run_vllm(vllm_python, tdir, prompt_file, max_tokens, out / "vllm" / "plain.json")
    say("ours: plain ...")
    ours_plain = run_ours(target, None, [], ids, max_tokens)["plain"]
    cross = sum(a == r["token_ids"] for a, r in zip(ours_plain["token_ids"], vplain["rows"]))
    res = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "machine": machine(), "target": target_spec, "k": k, "max_tokens": max_tokens,
           "prompts": [q.id for q in prompts],
           "vllm_version": vplain["vllm_version"],
           "plain_outputs_equal_across_engines": f"{cross}/{len(ids)}", "formats": {}}
    if update and (out / "results.json").is_file():
        res["formats"] = json.loads((out / "results.json").read_text())["formats"]
    ours: dict[tuple[str, str], tuple[dict, dict, dict]] = {}
    for fmt in formats:
        kind = EXPORTS[fmt].head_type
        head, _ = load_head(heads[kind])
        export_dir, cmd = export_head(head, fmt, out / "export" / fmt, verifier=str(tdir), k=k, target=target)
        say(f"exported {fmt}: {cmd}")
        shown = str(shown_from(heads[kind], Path.cwd()))
        try:
            vspec = run_vllm(vllm_python, tdir, prompt_file, max_tokens, out / "vllm" / f"{fmt}.json",
                             fmt, export_dir, k)
        except DraftheadsError as e:
            say(f"error: {e}")
            res["formats"][fmt] = {"head": shown, "error": str(e), "vllm_command": cmd}
            continue
        v_tau, v_pos = vllm_acceptance(vspec["counters"], k)
        options = EXPORTS[fmt].proposer_options
        mine = (kind, json.dumps(options, sort_keys=True))
        if mine not in ours:  # vllm-eagle3 and speculators share one head
            say(f"ours: {kind} chain{k} and small tree {options or ''}...")
            runs = run_ours(target, make_proposer(target, head=heads[kind], options=options),
                            [f"chain{k}", "small"], ids, max_tokens)
            ours[mine] = runs[f"chain{k}"], runs["small"], runs["plain"]
        chain, tree, plain_here = ours[mine]
        best = max(((f"chain{k}", chain), ("small", tree)), key=lambda x: x[1]["tok_s"])
        res["formats"][fmt] = {
            "head": shown, "vllm_tau": v_tau, "our_tau": chain["metrics"].tau,
            "identical_output": all(a["token_ids"] == b["token_ids"] for a, b in zip(vspec["rows"], vplain["rows"])),
            "ours_identical_to_our_plain": chain["token_ids"] == ours_plain["token_ids"] == tree["token_ids"],
            "vllm_per_position": v_pos, "our_per_position": chain["metrics"].alpha,
            "vllm_tok_s_plain": tok_s(vplain), "vllm_tok_s_spec": tok_s(vspec),
            "our_tok_s_plain": plain_here["tok_s"], "our_tok_s_spec": best[1]["tok_s"], "our_best_tree": best[0],
            "our_tok_s_chain": chain["tok_s"], "our_tau_best_tree": best[1]["metrics"].tau,
            "vllm_counters": vspec["counters"], "vllm_engine_start_s": vspec["engine_start_s"],
            "vllm_runner": "v2, Triton interpreted" if v2_interpreted(fmt) else "default", "our_proposer_options": options,
            "vllm_command": cmd, "measured_by": res["command"], "date": res["date"],
        }
        atomic_write_json(out / "results.json", res)  # after each format, so a failure keeps what was measured
    atomic_write_json(out / "results.json", res)
    table = markdown(res)
    atomic_write_text(out / "results.md", table)
    print(table)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}")
    bad = failures(res)
    if bad:
        say(f"error: {', '.join(bad)}: a vLLM run failed, its text differs from its plain text, or its tau is more "
            f"than {TAU_TOLERANCE:.0%} from ours (see the table)")
    return 1 if bad else 0


def failures(res: dict) -> list[str]:
    """The formats whose vLLM run failed, whose text differs from vLLM's plain text, or whose tau is more
    than TAU_TOLERANCE from ours."""
    return [f for f, r in res["formats"].items()
            if "error" in r or not r["identical_output"] or abs(tau_diff(r)) > TAU_TOLERANCE]


def tau_diff(r: dict) -> float:
    """Our chain tau relative to vLLM's."""
    return (r["our_tau"] - r["vllm_tau"]) / r["vllm_tau"]


def markdown(res: dict) -> str:
    lines = [f"`{res['command']}` ({res['date']}, {res['machine']['platform']}, {res['machine']['cpu_count']} CPUs, vLLM {res['vllm_version']}); K = {res['k']}, "
             f"{len(res['prompts'])} prompts, {res['max_tokens']} new tokens, greedy, batch 1.", "",
             "| format | head | vLLM tau | our tau (chain) | diff | vLLM alpha/pos | our alpha/pos | vLLM text = plain | "
             "vLLM tok/s plain / spec | our tok/s plain / spec (tree) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for fmt, r in res["formats"].items():
        if "error" in r:
            lines.append(f"| {fmt} | {r.get('head', '?')} | FAILED: {r['error']} |" + " |" * 7)
            continue
        lines.append(
            f"| {fmt} | {r.get('head', '?')} | {r['vllm_tau']:.3f} | {r['our_tau']:.3f} | {100 * tau_diff(r):+.1f} % | "
            f"{' '.join(f'{a:.2f}' for a in r['vllm_per_position'])} | "
            f"{' '.join(f'{a:.2f}' for a in r['our_per_position'])} | {'yes' if r['identical_output'] else 'NO'} | "
            f"{r['vllm_tok_s_plain']:.1f} / {r['vllm_tok_s_spec']:.1f}"
            f"{' (V2 runner, Triton interpreted: not vLLM speed)' if r.get('vllm_runner', 'default') != 'default' else ''} | "
            f"{r['our_tok_s_plain']:.1f} / {r['our_tok_s_spec']:.1f} ({r['our_best_tree']}) |")
    lines.append("")
    lines.append(f"Plain greedy outputs equal across the two engines: {res['plain_outputs_equal_across_engines']} prompts.")
    return "\n".join(lines) + "\n"
