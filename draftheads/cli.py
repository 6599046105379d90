"""``draftheads`` command line: one subcommand per job, each a typed function (:mod:`draftheads.options`
turns the signatures into flags). Bad input ends in one ``error:`` line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Annotated

from draftheads.errors import DraftheadsError
from draftheads.options import (
    CommandLine,
    DrafterOptions,
    EngineOptions,
    Flag,
    LoadOptions,
    SamplingOptions,
    TargetOptions,
    add_command,
    call,
    check_modes,
)
from draftheads.utils import check_writable_file

Positive = Annotated[int, Flag(low=1)]
PositiveOrNone = Annotated[int | None, Flag(low=1)]


class _Parser(argparse.ArgumentParser):
    """argparse with the project's error form: one ``error:`` line naming the fix, no usage dump."""

    def error(self, message):
        print(f"error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(2)


def info(target: TargetOptions) -> int:
    """Load a target and print its TargetInfo."""
    loaded = target.load().info
    print(json.dumps({k: (str(v) if k == "dtype" else v) for k, v in loaded.__dict__.items()}, indent=2))
    return 0


def generate(prompt: str, target: TargetOptions, drafter: DrafterOptions, sampling: SamplingOptions,
             max_new_tokens: Positive = 128, compare_plain: bool = False) -> int:
    """Answer one prompt with the engine and report tau, alpha and tokens/s.

    Args:
        prompt: the user turn
        max_new_tokens: tokens to write
        compare_plain: also run plain decoding and report the speedup
    """
    from draftheads.inference.build import check_drafter, make_engine, make_proposer
    from draftheads.inference.engine import Engine
    from draftheads.inference.sampling import SamplingParams
    from draftheads.prompts import encode_chat

    params = sampling.params(max_new_tokens)
    tree = drafter.mode()
    head = check_drafter(drafter.head, drafter.proposer)
    model = target.load()
    proposer = make_proposer(model, head, drafter.proposer)
    engine = make_engine(model, proposer, tree)
    tok = model.tokenizer
    ids = encode_chat(tok, [{"role": "user", "content": prompt}], name=target.target)
    engine.generate([ids[:8]], SamplingParams(max_new_tokens=2))  # warm-up
    (out,) = engine.generate([ids], params)
    print(tok.decode(out.token_ids, skip_special_tokens=True))
    m = out.metrics
    name = f"{proposer.name}, {engine.mode}" if proposer else "plain"
    line = f"[{name}] {m.emitted_tokens} tokens in {m.wall_time_s:.2f} s = {m.tokens_per_s:.1f} tok/s"
    if proposer:
        line += f"; {m.line()}"
    if engine.policy is not None:
        r = engine.policy.report().get(1, {})
        line += (f"; auto: {m.drafts}/{m.target_forwards} steps drafted, {r.get('tree_tokens_per_step', 0):.1f} "
                 f"tokens verified per drafted step, {r.get('predicted_tokens_per_step', 0):.2f} predicted against "
                 f"{r.get('measured_tokens_per_step', 0):.2f} measured tokens per step")
    if compare_plain and proposer:
        (plain,) = Engine(model.model, tok, None).generate([ids], params)
        line += (f"; plain {plain.metrics.tokens_per_s:.1f} tok/s; speedup "
                 f"{plain.metrics.wall_time_s / m.wall_time_s:.2f}x")
        if params.greedy:
            line += "; identical to plain" if plain.token_ids == out.token_ids else "; DIFFERS from plain"
    print(line)
    return 0


def distill(prompts: list[str], out: str, target: TargetOptions, sampling: SamplingOptions, engine: EngineOptions,
            domains: list[str] | None = None, limit_per_domain: PositiveOrNone = None,
            max_new_tokens: Positive = 256, max_seq_len: PositiveOrNone = None, batch_size: Positive = 32,
            features: str | None = None, feature_dir: str | None = None, val_fraction: float = 0.05,
            extend: bool = False) -> int:
    """The target answers prompts itself (self-distillation data), batched.

    Args:
        prompts: prompt files, or bundled:train / bundled:eval
        out: jsonl of conversations (turns, answers, truncated)
        domains: only these domains of the prompt files
        limit_per_domain: at most this many prompts per domain
        max_new_tokens: per answer; longer answers are marked truncated
        max_seq_len: tokens per conversation, prompts included (default: the target's context, at most 2048)
        batch_size: rows generated together (refilled as they finish)
        features: also keep hidden states of the generation pass: eagle3 | eagle | medusa | comma list of ids
        feature_dir: feature cache for train-head --data.feature_dir
        val_fraction: prompts held out as the cache's val split
        extend: OUT exists: answer only the prompts it lacks (the others unchanged), adding to its feature cache
    """
    from draftheads.datagen.backends import check_engine
    from draftheads.datagen.distill import check_distill
    from draftheads.datagen.distill import distill as run
    from draftheads.prompts import load_prompts
    from draftheads.targets import text_config

    sampling.params(max_new_tokens)
    rows = [p for f in prompts for p in load_prompts(f, domains=domains, limit_per_domain=limit_per_domain)]
    check_distill(rows, out, batch_size, features, feature_dir, val_fraction, extend)
    check_engine(engine.engine)
    model, opts = engine.target(target)  # vllm: only the tokenizer loads here, vLLM loads the weights
    num_layers = model.info.num_layers if engine.engine != "vllm" else text_config(target.target).num_hidden_layers
    layers = feature_layers(features, num_layers, "--features") if features else None
    path = run(model, rows, out, max_new_tokens, sampling.temperature, batch_size, sampling.seed,
               top_p=sampling.top_p, top_k=sampling.top_k, max_seq_len=max_seq_len, features=layers,
               feature_dir=feature_dir, val_fraction=val_fraction,
               progress=lambda m: print(m, file=sys.stderr, flush=True), engine=engine.engine, vllm=opts,
               extend=extend)
    print(path)
    return 0


def synthesize(out: str, target: TargetOptions, engine: EngineOptions,
               sampling: SamplingOptions = SamplingOptions(temperature=1.0, top_p=0.95),
               num_prompts: Positive = 600,
               domains: Annotated[tuple[str, ...] | None, Flag(choices="draftheads.datagen.synthesize:SYNTH_DOMAINS")]
               = None,
               multi_turn: float = 0.15, max_prompt_tokens: Positive = 160, batch_size: Positive = 64,
               dedup_threshold: float = 0.7, round_size: Positive = 192, extend: bool = False) -> int:
    """Prompts written by the target itself (Magpie), deduplicated, per domain.

    Args:
        out: prompt jsonl ({id, domain, turns}), for distill --prompts
        num_prompts: prompts to keep, shared equally by the domains
        domains: the domains to write (default: all)
        multi_turn: fraction of prompts given a follow-up turn
        max_prompt_tokens: longest user turn written (longer candidates are dropped)
        batch_size: rows generated together
        dedup_threshold: MinHash Jaccard above which prompts are near duplicates
        round_size: candidates per round (the unit of resume)
        extend: OUT exists: grow it to --num-prompts (its other settings unchanged)
    """
    from draftheads.datagen.synthesize import SYNTH_DOMAINS, SynthConfig
    from draftheads.datagen.synthesize import synthesize as run

    cfg = SynthConfig(num_prompts=num_prompts, domains=tuple(domains or SYNTH_DOMAINS), multi_turn=multi_turn,
                      temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                      max_prompt_tokens=max_prompt_tokens, batch_size=batch_size, dedup_threshold=dedup_threshold,
                      seed=sampling.seed, round_size=round_size)
    check_writable_file(out)
    model, opts = engine.target(target)
    path = run(model, out, cfg, progress=lambda m: print(m, file=sys.stderr, flush=True), engine=engine.engine,
               vllm=opts, extend=extend)
    stats = json.loads(path.with_name(path.name + ".stats.json").read_text())
    print("| domain | kept | candidates | near-dup rate | distinct-1 | distinct-2 | distinct-3 | multi-turn |")
    print("|---|---|---|---|---|---|---|---|")
    for d, s in stats["domains"].items():
        print(f"| {d} | {s['kept']} | {s['candidates']} | {s['near_dup_rate']:.3f} | {s['distinct_1']:.3f} | "
              f"{s['distinct_2']:.3f} | {s['distinct_3']:.3f} | {s['multi_turn']} |")
    print(path)
    return 0


def feature_layers(spec: str, num_layers: int, flag: str = "--layers") -> list[int]:
    """A head family's name (the layers its training reads), several joined by ``+`` (every layer any of
    them reads), or a comma list of HF hidden-state ids."""
    from draftheads.heads import FAMILIES

    names = spec.split("+")
    if all(n in FAMILIES for n in names):
        return sorted({i for n in names for i in FAMILIES[n].feature_layers(num_layers)})
    try:
        ids = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        ids = []
    if not ids:
        raise DraftheadsError(f"{flag} {spec!r}: use {', '.join(FAMILIES)} (several joined by +, e.g. eagle3+dflash) "
                              "or a comma list of ids like 2,15,27,30")
    from draftheads.targets import check_layer_ids

    return check_layer_ids(ids, num_layers, flag)


def cache_features(data: list[str], out: str, target: TargetOptions, layers: str = "eagle3",
                   max_length: Positive = 1024, val_fraction: float = 0.05, seed: int = 0, pack: bool = True,
                   batch_size: Positive = 4, overwrite: bool = False) -> int:
    """Write target hidden states for offline training.

    Args:
        data: training jsonl files (as data.train_files)
        out: the feature cache directory
        layers: eagle3 | eagle | medusa | comma list of HF hidden-state ids
        max_length: tokens per training row
        val_fraction: conversations held out as the val split (1: all, a set to validate heads on)
        seed: seed of the train/val split
        pack: pack short conversations into full rows
        batch_size: rows per target forward
        overwrite: replace --out even if it holds files this command did not write
    """
    from draftheads.training.data import build_dataset
    from draftheads.training.features import CACHE_FILES, write_feature_cache
    from draftheads.utils import check_output_dir

    if not 0 <= val_fraction <= 1:
        raise DraftheadsError(f"--val-fraction {val_fraction} must be in [0, 1] (1: all of it for validation)")
    check_output_dir(out, "cache-features", overwrite=overwrite, inputs=data, names=CACHE_FILES)
    model = target.load()
    train, val, stats = build_dataset(model.tokenizer, data, max_length, pack, val_fraction, seed,
                                      tokenizer_key=target.target)
    ids = feature_layers(layers, model.info.num_layers)
    rows = {"train": list(train), "val": list(val)}
    total, done = sum(len(r) for r in rows.values()), [0]

    def progress(n):
        done[0] += n
        print(f"cache-features: {done[0]}/{total} rows", file=sys.stderr, flush=True)

    path = write_feature_cache(model.model, rows, ids, out, target.target, batch_size=batch_size,
                               dtype=model.info.dtype, progress=progress, overwrite=overwrite, inputs=data)
    print(json.dumps({"out": str(path), "layers": ids, "rows": {k: len(v) for k, v in rows.items()},
                      "tokens": stats["train"]["tokens"] + stats["val"]["tokens"]}))
    return 0


def profile(target: TargetOptions, ks: Annotated[tuple[int, ...], Flag(sep=",", low=1)] = (1, 2, 4, 8, 16, 32, 64),
            prefix: Positive = 256, repeats: Positive = 5, batch: Positive = 1) -> int:
    """Measure target forward time for K = 1, 2, 4 ... 64 query tokens.

    Args:
        ks: query-token counts K
        prefix: context tokens before the K
        repeats: timed forwards per K (the median is kept)
        batch: rows per forward
    """
    from draftheads.inference.profile import save_profile, verify_curve

    model = target.load()
    curve = verify_curve(model.model, list(ks), prefix=prefix, repeats=repeats, batch=batch)
    path = save_profile(model.info.name, model.model, curve, prefix)
    base = curve[min(curve)]
    print(f"verify cost, {target.target} in {target.dtype}, prefix {prefix}, batch {batch} (median of {repeats})")
    print("| K query tokens | ms | x K=1 |")
    print("|---|---|---|")
    for k, ms in curve.items():
        print(f"| {k} | {ms:.1f} | {ms / base:.2f} |")
    print(f"saved to {path}")
    return 0


def export(head: str, format: Annotated[str, Flag(choices="draftheads.export.vllm:FORMATS")], out: str,
           load: LoadOptions, verifier: str | None = None, num_speculative_tokens: Positive = 3,
           overwrite: bool = False) -> int:
    """Export a head in a format vLLM loads unchanged.

    Formats: vllm-eagle3, speculators (eagle3), vllm-eagle (EAGLE-1, Llama targets), vllm-medusa (vLLM <= 0.32
    only: vLLM 0.33 removed Medusa; served as a top-1 chain), vllm-dflash (block drafter; serve with
    num_speculative_tokens <= block_size - 1), vllm-dspark (DFlash plus Markov and confidence heads; vLLM's
    V2 model runner).

    Args:
        head: head directory
        format: the export format
        out: the export directory
        verifier: target name or path (written into configs; supplies shared weights)
        num_speculative_tokens: K written into the serving config
        overwrite: replace --out even if it holds files this command did not write
    """
    from draftheads.export.vllm import EXPORT_FILES, export_head
    from draftheads.heads import check_head_fits_target, load_head
    from draftheads.heads.base import resolve_head
    from draftheads.targets import resolve_target
    from draftheads.utils import check_output_dir

    inputs = [resolve_head(head)]
    check_output_dir(out, "export", overwrite=overwrite, inputs=inputs, names=EXPORT_FILES)
    module, _ = load_head(head)
    model = serve = None
    if verifier:
        model = load.load(verifier)
        check_head_fits_target(module, model.info)
        serve = str(resolve_target(verifier))  # what vLLM loads (the cached safetensors dir for a GGUF)
    path, command = export_head(module, format, out, verifier, num_speculative_tokens, model, serve_target=serve,
                                overwrite=overwrite, inputs=inputs)
    print(f"wrote {format} to {path} (validated: key set, shapes, dtypes, config fields"
          + (", and its serving contract with the target)" if verifier else ")"))
    print(command)
    return 0


def import_(src: Annotated[str, Flag(positional=True)],
            source: Annotated[str, Flag(name="--from", choices="draftheads.export.imports:SOURCES")], out: str,
            target_layers: PositiveOrNone = None, overwrite: bool = False) -> int:
    """Import a public Medusa / EAGLE / EAGLE-3 / speculators / DFlash / DSpark checkpoint.

    Args:
        src: checkpoint directory or weight file
        source: the checkpoint's format
        out: the head directory to write
        target_layers: target layer count, when the checkpoint omits aux ids
        overwrite: replace --out even if it holds files this command did not write
    """
    from draftheads.export.imports import import_checkpoint
    from draftheads.heads.base import HEAD_FILES
    from draftheads.utils import check_output_dir

    check_output_dir(out, "head", overwrite=overwrite, inputs=[src], names=HEAD_FILES)
    head = import_checkpoint(source, src, out, target_layers, overwrite=overwrite)
    print(f"imported {head.head_type} head to {out}")
    return 0


def _drafter_on_prompts(command: str, out: str, target: TargetOptions, drafter: DrafterOptions,
                        prompts: tuple[str, ...], limit_per_domain: int | None):
    """What eval and walk start from, checked before the target loads: (the target, its proposer, the prompts)."""
    from draftheads.inference.build import check_drafter, make_proposer
    from draftheads.prompts import check_unique_ids, load_prompts
    from draftheads.utils import check_writable_dir

    if not drafter.head and not drafter.proposer:
        raise DraftheadsError(f"draftheads {command} needs --head DIR or --proposer ngram")
    check_writable_dir(out)
    head = check_drafter(drafter.head, drafter.proposer)
    rows = [p for f in prompts for p in load_prompts(f, limit_per_domain=limit_per_domain)]
    check_unique_ids(rows)
    model = target.load()
    return model, make_proposer(model, head, drafter.proposer), rows


def eval_(out: str, target: TargetOptions, sampling: SamplingOptions, command_line: CommandLine,
          drafter: DrafterOptions = DrafterOptions(tree=("auto", "chain3")),
          prompts: tuple[str, ...] = ("bundled:eval",), max_new_tokens: Positive = 128, batch_size: Positive = 1,
          limit_per_domain: PositiveOrNone = None) -> int:
    """Acceptance (tau, alpha) and speedup per domain, plain vs speculative.

    Every mode of --tree is measured against the same plain run.

    Args:
        out: results directory (results.json, results.md, plots)
        prompts: prompt files (project jsonl, Spec-Bench/MT-bench, GSM8K, HumanEval) or bundled:eval
        max_new_tokens: tokens per answer
        batch_size: prompts decoded together
        limit_per_domain: at most this many prompts per domain
    """
    from draftheads import evaluation

    params = sampling.params(max_new_tokens)
    model, proposer, rows = _drafter_on_prompts("eval", out, target, drafter, prompts, limit_per_domain)
    results = evaluation.evaluate(model, proposer, list(drafter.tree), rows, params, batch_size)
    meta = {"command": command_line, "target": target.target, "head": drafter.head, "proposer": proposer.name,
            "tree": list(drafter.tree), "temperature": sampling.temperature, "top_p": sampling.top_p,
            "top_k": sampling.top_k, "max_new_tokens": max_new_tokens, "batch_size": batch_size,
            "seed": sampling.seed, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": evaluation.machine()}
    res = evaluation.report(results, meta)
    files = evaluation.write_results(res, out)
    print(evaluation.markdown(res))
    print("wrote " + ", ".join(str(f) for f in files))
    real = {m: v["overall"]["real_divergences"] for m, v in res["modes"].items() if v["overall"]["real_divergences"]}
    if real:
        print(f"error: greedy output differs from plain decoding beyond near ties ({real}): the engine is not "
              "lossless here; please report it with results.json", file=sys.stderr)
        return 1
    return 0


def walk(out: str, target: TargetOptions, command_line: CommandLine,
         drafter: DrafterOptions = DrafterOptions(tree=("chain3", "small", "medium")),
         prompts: tuple[str, ...] = ("bundled:eval",), max_new_tokens: Positive = 128,
         limit_per_domain: PositiveOrNone = None, batch_size: Positive = 16) -> int:
    """Walked tau: the eval's greedy tau and alpha per mode and domain, from the head's drafts replayed
    along the target's greedy answers (one target forward per answer, no timed decoding).

    Args:
        out: results directory (results.json, results.md)
        prompts: prompt files or bundled:eval (as draftheads eval takes them)
        max_new_tokens: tokens per answer
        limit_per_domain: at most this many prompts per domain
        batch_size: answers decoded, and walked, together
    """
    from draftheads import evaluation
    from draftheads.inference import replay
    from draftheads.inference.tree import parse_tree
    from draftheads.utils import atomic_write_json, atomic_write_text

    if "auto" in drafter.tree:
        raise DraftheadsError("--tree auto cannot be walked (what it drafts depends on step times): "
                              "give fixed modes, e.g. --tree chain3,small,medium")
    specs = {m: parse_tree(m) for m in drafter.tree}
    model, proposer, rows = _drafter_on_prompts("walk", out, target, drafter, prompts, limit_per_domain)
    for spec in specs.values():
        proposer.check_tree(spec)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    texts = replay.greedy_texts(model, rows, max_new_tokens, batch_size)
    hidden = replay.capture(model.model, texts, proposer.layer_ids)
    seconds = {"texts": time.perf_counter() - t0}
    say(f"walk: {len(texts)} greedy answers and their hidden states in {seconds['texts']:.0f} s")
    res = {"kind": "walk", "command": command_line, "target": target.target, "head": drafter.head,
           "proposer": proposer.name, "dtype": target.dtype, "max_new_tokens": max_new_tokens, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "machine": evaluation.machine(), "seconds": seconds, "modes": {}}
    for mode, spec in specs.items():
        t0 = time.perf_counter()
        metrics = replay.walk(proposer, texts, hidden, spec, rows=batch_size)
        seconds[mode] = time.perf_counter() - t0
        res["modes"][mode] = replay.summary(texts, metrics)
        say(f"walk: {mode}: tau {res['modes'][mode]['overall']['tau']:.3f} in {seconds[mode]:.0f} s")
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path / "results.json", res)
    text = replay.markdown(res)
    atomic_write_text(path / "results.md", text)
    print(text)
    print(f"wrote {path / 'results.json'}, {path / 'results.md'}")
    return 0


def bench(out: str, target: TargetOptions, command_line: CommandLine,
          heads: Annotated[dict[str, str] | None, Flag(choices="draftheads.heads:FAMILIES")] = None,
          tree: Annotated[tuple[str, ...], Flag(sep=",")] = ("auto",), prompts: str = "bundled:eval",
          limit_per_domain: Positive = 1,
          max_new_tokens: Positive = 128, batch_tokens: Positive = 32,
          batches: Annotated[tuple[int, ...], Flag(sep=",", low=1)] = (1, 2, 4, 8, 16), batch_repeats: Positive = 3,
          repeats: Positive = 5, datagen_batch: Positive = 64, lm_head_check: bool = False, own_text: bool = False,
          only: Annotated[tuple[str, ...] | None, Flag(sep=",", choices="draftheads.bench.speed:PARTS")] = None,
          ) -> int:
    """Verify curve, proposer speeds, batch sweep, loss memory and the engine's best case, side by side.

    Each head given is timed in every --tree mode and as a chain of 3 (vLLM's serving mode).

    Args:
        out: results directory (results.json, results.md, plots)
        heads: a head directory of this family
        tree: modes of each head beside chain3: auto and/or trees, e.g. auto,small
        prompts: prompt file or bundled:eval
        limit_per_domain: prompts per domain
        max_new_tokens: tokens per answer in the proposers part
        batch_tokens: new tokens per row in the batch sweep
        batches: batch sizes of the sweep
        batch_repeats: interleaved plain/speculative pairs per batch size (more pairs resolve smaller differences)
        repeats: timed forwards per point of the verify curve
        datagen_batch: batch of the datagen part (2x as many prompts)
        lm_head_check: proposers part: also time the first head on a fixed tree with the full lm_head projection
        own_text: each mode decodes its own greedy text, instead of every engine verifying along plain decoding's
            (in reduced precision near ties flip with the verify shape, and the texts then differ by mode)
        only: the parts to run (default: all)
    """
    from pathlib import Path

    from draftheads import evaluation
    from draftheads.bench import speed
    from draftheads.inference.build import check_drafter, make_proposer
    from draftheads.prompts import encode_chat, load_prompts
    from draftheads.utils import atomic_write_json, atomic_write_text, check_writable_dir

    parts = list(only or speed.PARTS)
    modes = check_modes(tree)
    drafts = {name: check_drafter(d) for name, d in (heads or {}).items()}
    check_writable_dir(out)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    res = {"command": command_line, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": evaluation.machine(),
           "target": target.target, "dtype": target.dtype}
    model = None
    if set(parts) - {"memory"}:
        model = target.load()
        tok = model.tokenizer
        rows = [encode_chat(tok, [{"role": "user", "content": p.turns[0]}], name=target.target)
                for p in load_prompts(prompts, limit_per_domain=limit_per_domain)]
        from draftheads.inference.engine import EngineConfig

        ngram = make_proposer(model, proposer="ngram")
        proposers = {f"ngram ({m})": (ngram, m, None) for m in (["auto"] if "auto" in modes else ["chain4"])}
        lm_head = {}  # what projecting only the walked nodes saves, on a fixed tree (proposers part)
        for name, head in drafts.items():  # each head in the modes asked for and in vLLM's serving mode, chain 3
            proposer = make_proposer(model, head=head)
            for m in (*modes, *(() if "chain3" in modes else ("chain3",))):
                proposers[f"{name} ({m})"] = (proposer, m, None)
            if lm_head_check and not lm_head:
                fixed = next((m for m in modes if m != "auto"), "medium")
                lm_head = {f"{name} ({fixed}, lazy lm_head)": (proposer, fixed, None),
                           f"{name} ({fixed}, full lm_head)": (proposer, fixed, EngineConfig(lazy_lm_head=False))}
    if "verify" in parts:
        from draftheads.inference.profile import verify_curve

        curve = verify_curve(model.model, prefix=256, repeats=repeats)
        res["verify_curve"] = {str(k): v for k, v in curve.items()}
        res["memory_bound"] = speed.memory_bound_check(model.model, curve)
        say(f"verify curve: {res['verify_curve']}")
    if "proposers" in parts:
        res["proposers"] = speed.proposer_speeds(model, {**proposers, **lm_head}, rows, max_new_tokens, progress=say,
                                                 one_text=not own_text)
    if "batch" in parts:
        res["batch_sweep"] = speed.batch_sweep(model, proposers, rows, batch_tokens, list(batches),
                                               repeats=batch_repeats, progress=say, one_text=not own_text)
    if "ceiling" in parts:
        res["ceiling"] = speed.ceiling(model, rows, max_new_tokens, progress=say)
    if "datagen" in parts:
        gen_prompts = [encode_chat(tok, [{"role": "user", "content": p.turns[0]}], name=target.target)
                       for p in load_prompts("bundled:train")][: 2 * datagen_batch]
        res["datagen"] = speed.datagen(model, gen_prompts, max_new_tokens, datagen_batch, progress=say)
    if "memory" in parts:
        from draftheads.bench.loss_memory import run

        res["loss_memory"] = run(tokens=4096, progress=say)["vocab"]
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path / "results.json", res)
    text = speed.tables(res)
    atomic_write_text(path / "results.md", text)
    files = speed.plots(res, path)
    print(text)
    print("wrote " + ", ".join(str(f) for f in [path / "results.json", path / "results.md", *files]))
    return 0


def serve_check(target: TargetOptions, command_line: CommandLine,
                heads: Annotated[dict[str, str] | None, Flag(choices="draftheads.heads:FAMILIES")] = None,
                formats: Annotated[tuple[str, ...], Flag(sep=",", choices="draftheads.export.vllm:EXPORTS")] = (
                    "vllm-eagle3", "speculators", "vllm-eagle", "vllm-medusa"),
                k: Positive = 3, max_tokens: Positive = 64, prompts: str = "bundled:eval", limit_per_domain: Positive = 1,
                vllm_python: str = ".venv-vllm/bin/python", out: str = "runs/vllm-check", update: bool = False) -> int:
    """Serve exported heads in vLLM itself and compare with this engine: text, τ and α per position, speed.

    Args:
        heads: the head of each family a format needs (default: the shipped one, a demo head, or one trained
            here for 2 minutes)
        formats: the export formats to serve
        k: num_speculative_tokens (vLLM) = chain length (ours)
        max_tokens: new tokens per prompt
        prompts: prompt file, or bundled:eval
        limit_per_domain: prompts per domain
        vllm_python: python of vLLM's environment (make vllm-check builds .venv-vllm)
        out: results directory
        update: keep the other formats already in OUT/results.json and measure only --formats
    """
    from draftheads.export.serve_check import serve_check as run

    model = target.load()
    return run(model, target.target, heads or {}, list(formats), k, max_tokens, prompts, limit_per_domain, vllm_python,
               out, update, command_line)


def report(check: bool = False) -> int:
    """Render every published results table from the JSON its command wrote (docs/results, the README headline).

    Args:
        check: write nothing; exit 1 when a committed table differs from its render
    """
    from pathlib import Path

    from draftheads.bench.report import report as run

    changed = run(Path.cwd(), write=not check)
    for p in changed:
        print(f"{'differs' if check else 'rendered'}: {p.relative_to(Path.cwd())}")
    return 1 if check and changed else 0


def recipe(action: Annotated[str, Flag(positional=True, choices="draftheads.recipe.run:ACTIONS")],
           file: Annotated[str, Flag(positional=True)],
           set_: Annotated[list[str] | None, Flag(name="--set")] = None, redo: str = "", only: str = "",
           dry_run: bool = False) -> int:
    """Take a target to a packaged head: every stage of a recipe file (see recipes/), resumable.

    Args:
        action: run (the stages), or fits (write the configs of the unfinished fits of --only, default
            train,extend, and print their paths in order: for a training job on a cluster)
        file: the recipe YAML
        set_: override recipe fields, e.g. --set data.synthesize=8600 heads.0.epochs=1
        redo: comma list of stages to make again (and the ones after them), or all
        only: comma list of the stages to run, the others left as they are
        dry_run: print every stage's commands and settings; load no model, write nothing
    """
    from draftheads.recipe.run import run_recipe, write_fits

    if action == "fits":
        for cfg in write_fits(file, set_ or [], only):
            print(cfg)
        return 0
    return run_recipe(file, set_ or [], redo, only, dry_run)


COMMANDS = {"info": info, "generate": generate, "distill": distill, "synthesize": synthesize,
            "cache-features": cache_features, "profile": profile, "export": export, "import": import_,
            "eval": eval_, "walk": walk, "bench": bench, "serve-check": serve_check, "report": report, "recipe": recipe}
"""Subcommand name -> its function; the function's signature is its flags."""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="draftheads", description="Train, evaluate, export and serve speculative-decoding "
                                                    "draft heads on a frozen causal LM.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, fn in COMMANDS.items():
        add_command(sub, name, fn)
    return parser


def _quiet_progress_bars() -> None:
    """No loading or dataset-saving bars from transformers and datasets (downloads keep theirs)."""
    import os

    import transformers.utils.logging

    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # read when datasets is imported
    if "datasets" in sys.modules:
        sys.modules["datasets"].utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if not args.verbose:
        _quiet_progress_bars()
    try:
        return call(args.func, args, "draftheads " + " ".join(argv))
    except DraftheadsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
