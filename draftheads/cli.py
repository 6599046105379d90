"""``draftheads`` command line: one subcommand per job. Bad input ends in one ``error:`` line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from draftheads.errors import DraftheadsError
from draftheads.inference.sampling import SamplingParams
from draftheads.targets import DEFAULT_TARGET
from draftheads.utils import check_writable_file


class _Parser(argparse.ArgumentParser):
    """argparse with the project's error form: one ``error:`` line naming the fix, no usage dump."""

    def error(self, message):
        print(f"error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(2)


def _sampling(args) -> SamplingParams:
    """The sampling flags, checked before anything is loaded."""
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=getattr(args, "top_k", 0),
                          max_new_tokens=args.max_new_tokens, seed=args.seed)


def _trees(spec: str, flag: str = "--tree") -> list[str]:
    """The comma list of tree modes, each one parsed (so a tree too large fails before drafting)."""
    from draftheads.inference.tree import parse_tree

    modes = [m.strip() for m in spec.split(",") if m.strip()]
    if not modes or len(set(modes)) != len(modes):
        raise DraftheadsError(f"{flag} {spec!r}: give one or more distinct modes, e.g. auto,chain3")
    for m in modes:
        if m != "auto":
            parse_tree(m)
    return modes


def _one_tree(spec: str) -> str:
    modes = _trees(spec)
    if len(modes) > 1:
        raise DraftheadsError(f"--tree {spec!r}: give one mode here (eval takes a list)")
    return modes[0]


def _ints(spec: str, flag: str, low: int = 1) -> list[int]:
    try:
        values = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < low:
        raise DraftheadsError(f"{flag} {spec!r}: give a comma list of whole numbers >= {low}, like 1,4,16")
    return values


def _at_least(value: int, flag: str, low: int = 1) -> int:
    if value < low:
        raise DraftheadsError(f"{flag} {value} must be >= {low}")
    return value


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target spec (default {DEFAULT_TARGET})")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default auto: cuda when present)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom modeling code from the hub")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from draftheads.training.backends import DEFAULT_VLLM_PYTHON, ENGINES

    p.add_argument("--engine", default=ENGINES[0], choices=list(ENGINES),
                   help="who writes the text: the project's engine (with features) or vLLM (text only)")
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON, help="python of vLLM's environment")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM tensor parallelism")
    p.add_argument("--data-parallel-size", type=int, default=1, help="vLLM data parallelism")


def _engine_target(args):
    """(target, vLLM options) for ``--engine``: the loaded target, or (vllm) the spec and the options."""
    if args.engine != "vllm":
        return _load_target(args), None
    return args.target, {"python": args.vllm_python, "dtype": args.dtype,
                         "tensor_parallel_size": _at_least(args.tensor_parallel_size, "--tensor-parallel-size"),
                         "data_parallel_size": _at_least(args.data_parallel_size, "--data-parallel-size")}


def _device(spec: str):
    """``--device``: auto (cuda when present), cpu, cuda or cuda:N; checked before any model loads."""
    import torch

    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise DraftheadsError(f"--device {spec!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DraftheadsError(f"--device {spec}: this machine has no CUDA device: use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DraftheadsError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif device.type != "cpu":
        raise DraftheadsError(f"--device {spec}: use auto, cpu, cuda or cuda:N")
    return device


def _load_target(args, spec: str | None = None):
    """The target of ``--target`` (or ``spec``) with ``--dtype``, ``--device`` and ``--trust-remote-code``."""
    from draftheads.targets import load_target

    return load_target(spec or args.target, dtype=args.dtype, device=_device(args.device),
                       trust_remote_code=args.trust_remote_code)


def cmd_info(args) -> int:

    info = _load_target(args).info
    d = {k: (str(v) if k == "dtype" else v) for k, v in info.__dict__.items()}
    print(json.dumps(d, indent=2))
    return 0


def cmd_generate(args) -> int:
    from draftheads.inference.build import check_drafter, make_engine, make_proposer
    from draftheads.inference.engine import Engine
    from draftheads.prompts import encode_chat

    params = _sampling(args)
    tree = _one_tree(args.tree)
    head = check_drafter(args.head, args.proposer)
    target = _load_target(args)
    proposer = make_proposer(target, head, args.proposer)
    engine = make_engine(target, proposer, tree)
    tok = target.tokenizer
    ids = encode_chat(tok, [{"role": "user", "content": args.prompt}], name=args.target)
    engine.generate([ids[:8]], SamplingParams(max_new_tokens=2))  # warm-up
    (out,) = engine.generate([ids], params)
    print(tok.decode(out.token_ids, skip_special_tokens=True))
    m = out.metrics
    name = f"{proposer.name}, {engine.mode}" if proposer else "plain"
    line = f"[{name}] {m.emitted_tokens} tokens in {m.wall_time_s:.2f} s = {m.tokens_per_s:.1f} tok/s"
    if proposer:
        line += f"; {m.line()}"
    if engine.policy is not None:
        line += f"; auto: {m.drafts}/{m.target_forwards} steps drafted, best arm {engine.policy.best(1) or 'plain'}"
    if args.compare_plain and proposer:
        (plain,) = Engine(target.model, tok, None).generate([ids], params)
        line += (f"; plain {plain.metrics.tokens_per_s:.1f} tok/s; speedup "
                 f"{plain.metrics.wall_time_s / m.wall_time_s:.2f}x")
        if params.greedy:
            line += "; identical to plain" if plain.token_ids == out.token_ids else "; DIFFERS from plain"
    print(line)
    return 0


def cmd_distill(args) -> int:
    from draftheads.prompts import load_prompts
    from draftheads.training.backends import check_engine
    from draftheads.training.distill import check_distill, distill

    _sampling(args)
    prompts = [p for f in args.prompts for p in load_prompts(f, domains=args.domains,
                                                               limit_per_domain=args.limit_per_domain)]
    check_distill(prompts, args.out, args.batch_size, args.features, args.feature_dir, args.val_fraction)
    progress = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    check_engine(args.engine, args.features)
    target, opts = _engine_target(args)  # vllm: only the tokenizer loads here, vLLM loads the weights
    torch_threads(args)
    layers = feature_layers(args.features, target.info.num_layers, "--features") if args.features else None
    out = distill(target, prompts, args.out, args.max_new_tokens, args.temperature, args.batch_size, args.seed,
                  top_p=args.top_p, max_seq_len=args.max_seq_len, features=layers, feature_dir=args.feature_dir,
                  val_fraction=args.val_fraction, progress=progress, engine=args.engine, vllm=opts)
    print(out)
    return 0


def cmd_synthesize(args) -> int:
    from draftheads.training.synthesize import SynthConfig, synthesize

    cfg = SynthConfig(num_prompts=args.num_prompts, domains=tuple(args.domains), multi_turn=args.multi_turn,
                      temperature=args.temperature, top_p=args.top_p, max_prompt_tokens=args.max_prompt_tokens,
                      batch_size=args.batch_size, dedup_threshold=args.dedup_threshold, seed=args.seed,
                      round_size=args.round_size)
    check_writable_file(args.out)
    target, opts = _engine_target(args)
    torch_threads(args)
    out = synthesize(target, args.out, cfg, progress=lambda m: print(m, file=sys.stderr, flush=True),
                     engine=args.engine, vllm=opts)
    stats = json.loads(out.with_name(out.name + ".stats.json").read_text())
    print("| domain | kept | candidates | near-dup rate | distinct-1 | distinct-2 | distinct-3 | multi-turn |")
    print("|---|---|---|---|---|---|---|---|")
    for d, s in stats["domains"].items():
        print(f"| {d} | {s['kept']} | {s['candidates']} | {s['near_dup_rate']:.3f} | {s['distinct_1']:.3f} | "
              f"{s['distinct_2']:.3f} | {s['distinct_3']:.3f} | {s['multi_turn']} |")
    print(out)
    return 0


def feature_layers(spec: str, num_layers: int, flag: str = "--layers") -> list[int]:
    """A head family's name (the layers its training reads) or a comma list of HF hidden-state ids."""
    from draftheads.heads import FAMILIES

    if spec in FAMILIES:
        return FAMILIES[spec].feature_layers(num_layers)
    try:
        ids = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        ids = []
    if not ids:
        raise DraftheadsError(f"{flag} {spec!r}: use {', '.join(FAMILIES)} or a comma list of ids like 2,15,27,30")
    from draftheads.targets import check_layer_ids

    return check_layer_ids(ids, num_layers, flag)


def cmd_cache_features(args) -> int:
    from draftheads.training.data import build_dataset
    from draftheads.training.features import CACHE_FILES, write_feature_cache
    from draftheads.utils import check_output_dir

    check_output_dir(args.out, "cache-features", overwrite=args.overwrite, inputs=args.data, names=CACHE_FILES)
    target = _load_target(args)
    train, val, stats = build_dataset(target.tokenizer, args.data, args.max_length, not args.no_pack,
                                      args.val_fraction, args.seed, tokenizer_key=args.target)
    layers = feature_layers(args.layers, target.info.num_layers)
    rows = {"train": list(train), "val": list(val)}
    total, done = sum(len(r) for r in rows.values()), [0]

    def progress(n):
        done[0] += n
        print(f"cache-features: {done[0]}/{total} rows", file=sys.stderr, flush=True)

    out = write_feature_cache(target.model, rows, layers, args.out, args.target, batch_size=args.batch_size,
                              dtype=target.info.dtype, progress=progress, overwrite=args.overwrite,
                              inputs=args.data)
    print(json.dumps({"out": str(out), "layers": layers, "rows": {k: len(v) for k, v in rows.items()},
                      "tokens": stats["train"]["tokens"] + stats["val"]["tokens"]}))
    return 0


def cmd_profile(args) -> int:
    from draftheads.inference.profile import save_profile, verify_curve

    ks = _ints(args.ks, "--ks")
    for flag in ("prefix", "repeats", "batch"):
        _at_least(getattr(args, flag), f"--{flag}")
    target = _load_target(args)
    curve = verify_curve(target.model, ks, prefix=args.prefix, repeats=args.repeats, batch=args.batch)
    path = save_profile(args.target, str(target.model.device), curve, args.prefix)
    base = curve[min(curve)]
    print(f"verify cost, {args.target}, prefix {args.prefix}, batch {args.batch} (median of {args.repeats})")
    print("| K query tokens | ms | x K=1 |")
    print("|---|---|---|")
    for k, ms in curve.items():
        print(f"| {k} | {ms:.1f} | {ms / base:.2f} |")
    print(f"saved to {path}")
    return 0


def cmd_export(args) -> int:
    from draftheads.export.vllm import EXPORT_FILES, export_head
    from draftheads.heads import check_head_fits_target, load_head
    from draftheads.heads.base import resolve_head
    from draftheads.utils import check_output_dir

    _at_least(args.num_speculative_tokens, "--num-speculative-tokens")
    inputs = [resolve_head(args.head)]
    check_output_dir(args.out, "export", overwrite=args.overwrite, inputs=inputs, names=EXPORT_FILES)
    head, _ = load_head(args.head)
    target = None
    if args.verifier:

        target = _load_target(args, args.verifier)
        check_head_fits_target(head, target.info)
    serve = None
    if args.verifier:
        from draftheads.targets import resolve_target

        serve = str(resolve_target(args.verifier))  # what vLLM loads (the cached safetensors dir for a GGUF)
    path, command = export_head(head, args.format, args.out, args.verifier, args.num_speculative_tokens, target,
                                serve_target=serve, overwrite=args.overwrite, inputs=inputs)
    print(f"wrote {args.format} to {path} (validated: key set, shapes, dtypes, config fields)")
    print(command)
    return 0


def cmd_import(args) -> int:
    from draftheads.export.imports import import_checkpoint
    from draftheads.heads.base import HEAD_FILES
    from draftheads.utils import check_output_dir

    check_output_dir(args.out, "head", overwrite=args.overwrite, inputs=[args.src], names=HEAD_FILES)
    head = import_checkpoint(args.source, args.src, args.out, args.target_layers, overwrite=args.overwrite)
    print(f"imported {head.head_type} head to {args.out}")
    return 0


def cmd_eval(args) -> int:
    from draftheads import evaluation
    from draftheads.inference.build import check_drafter, make_proposer
    from draftheads.prompts import check_unique_ids, load_prompts
    from draftheads.utils import check_writable_dir

    if not args.head and not args.proposer:
        raise DraftheadsError("draftheads eval needs --head DIR or --proposer ngram")
    _at_least(args.batch_size, "--batch-size")
    params = _sampling(args)
    modes = _trees(args.tree)
    check_writable_dir(args.out)
    head = check_drafter(args.head, args.proposer)
    prompts = [p for f in args.prompts for p in load_prompts(f, limit_per_domain=args.limit_per_domain)]
    check_unique_ids(prompts)
    target = _load_target(args)
    torch_threads(args)
    proposer = make_proposer(target, head, args.proposer)
    results = evaluation.evaluate(target, proposer, modes, prompts, params, args.batch_size)
    name = proposer.name
    meta = {"command": "draftheads " + " ".join(sys.argv[1:] if args.argv is None else args.argv),
            "target": args.target, "head": args.head, "proposer": name, "tree": modes,
            "temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
            "seed": args.seed, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": evaluation.machine()}
    res = evaluation.report(results, meta)
    files = evaluation.write_results(res, args.out)
    print(evaluation.markdown(res))
    print("wrote " + ", ".join(str(f) for f in files))
    real = {m: v["overall"]["real_divergences"] for m, v in res["modes"].items() if v["overall"]["real_divergences"]}
    if real:
        print(f"error: greedy output differs from plain decoding beyond near ties ({real}): the engine is not "
              "lossless here; please report it with results.json", file=sys.stderr)
        return 1
    return 0


def cmd_bench(args) -> int:
    from pathlib import Path

    from draftheads import evaluation
    from draftheads.bench import speed
    from draftheads.inference.build import check_drafter, make_proposer
    from draftheads.inference.tree import DEFAULT_TREE
    from draftheads.prompts import encode_chat, load_prompts
    from draftheads.utils import atomic_write_json, atomic_write_text, check_writable_dir

    parts = [p.strip() for p in args.only.split(",") if p.strip()] if args.only is not None else list(speed.PARTS)
    unknown = set(parts) - set(speed.PARTS)
    if unknown or not parts:
        raise DraftheadsError(f"--only {args.only!r}: give a comma list of some of {', '.join(speed.PARTS)}")
    batches = _ints(args.batches, "--batches")
    for flag in ("batch_repeats", "repeats", "max_new_tokens", "batch_tokens", "datagen_batch", "limit_per_domain"):
        _at_least(getattr(args, flag), "--" + flag.replace("_", "-"))
    tree = _one_tree(args.tree or DEFAULT_TREE)
    from draftheads.heads import FAMILIES

    heads = {name: check_drafter(getattr(args, name)) for name in FAMILIES if getattr(args, name)}
    check_writable_dir(args.out)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    res = {"command": "draftheads " + " ".join(sys.argv[1:] if args.argv is None else args.argv),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": evaluation.machine(), "target": args.target}
    target = None
    if set(parts) - {"memory"}:
        target = _load_target(args)
        tok = target.tokenizer
        prompts = [encode_chat(tok, [{"role": "user", "content": p.turns[0]}], name=args.target)
                   for p in load_prompts(args.prompts, limit_per_domain=args.limit_per_domain)]
        from draftheads.inference.engine import EngineConfig

        ngram = make_proposer(target, proposer="ngram")
        proposers = {f"ngram ({tree})": (ngram, tree if tree == "auto" else "chain4", None)}
        lm_head_check = {}  # what projecting only the walked nodes saves, on a fixed tree (proposers part)
        for name, head in heads.items():  # each head in the tree mode asked for and in vLLM's serving mode, chain 3
            proposer = make_proposer(target, head=head)
            proposers[f"{name} ({tree})"] = (proposer, tree, None)
            if tree != "chain3":
                proposers[f"{name} (chain3)"] = (proposer, "chain3", None)
            if args.lm_head_check and not lm_head_check:
                fixed = tree if tree != "auto" else "medium"
                lm_head_check = {f"{name} ({fixed}, lazy lm_head)": (proposer, fixed, None),
                                 f"{name} ({fixed}, full lm_head)": (proposer, fixed, EngineConfig(lazy_lm_head=False))}
    if "verify" in parts:
        from draftheads.inference.profile import verify_curve

        curve = verify_curve(target.model, prefix=256, repeats=args.repeats)
        res["verify_curve"] = {str(k): v for k, v in curve.items()}
        res["memory_bound"] = speed.memory_bound_check(target.model, curve)
        say(f"verify curve: {res['verify_curve']}")
    if "proposers" in parts:
        res["proposers"] = speed.proposer_speeds(target, {**proposers, **lm_head_check}, prompts, args.max_new_tokens,
                                                 progress=say)
    if "batch" in parts:
        res["batch_sweep"] = speed.batch_sweep(target, proposers, prompts, args.batch_tokens, batches,
                                               repeats=args.batch_repeats, progress=say)
    if "datagen" in parts:
        gen_prompts = [encode_chat(tok, [{"role": "user", "content": p.turns[0]}], name=args.target)
                       for p in load_prompts("bundled:train")][: 2 * args.datagen_batch]
        res["datagen"] = speed.datagen(target, gen_prompts, args.max_new_tokens, args.datagen_batch, progress=say)
    if "memory" in parts:
        from draftheads.bench.loss_memory import run

        res["loss_memory"] = run(tokens=4096, progress=say)["vocab"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "results.json", res)
    text = speed.tables(res)
    atomic_write_text(out / "results.md", text)
    files = speed.plots(res, out)
    print(text)
    print("wrote " + ", ".join(str(f) for f in [out / "results.json", out / "results.md", *files]))
    return 0


def torch_threads(args) -> None:
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="draftheads", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="load a target and print its TargetInfo")
    _add_target_args(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("generate", help="answer one prompt with the engine and report tau, alpha and tokens/s")
    _add_target_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--head", default=None, help="head directory (train-head or draftheads import output)")
    p.add_argument("--proposer", default=None, help="head-less proposer: ngram")
    p.add_argument("--tree", default="auto",
                   help="auto (default) | small | medium | large | chainK | static-tree JSON file (Medusa); auto "
                        "picks plain decoding or a tree each step by measured throughput")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-plain", action="store_true", help="also run plain decoding and report the speedup")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("distill", help="the target answers prompts itself (self-distillation data), batched")
    _add_target_args(p)
    p.add_argument("--prompts", nargs="+", required=True, help="prompt files, or bundled:train / bundled:eval")
    p.add_argument("--out", required=True, help="jsonl of conversations (turns, answers, truncated)")
    p.add_argument("--domains", nargs="*", default=None)
    p.add_argument("--limit-per-domain", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=256, help="per answer; longer answers are marked truncated")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="tokens per conversation, prompts included (default: the target's context, at most 2048)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=32, help="rows generated together (refilled as they finish)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--features", default=None,
                   help="also keep hidden states of the generation pass: eagle3 | eagle | medusa | comma list of ids")
    p.add_argument("--feature-dir", default=None, help="feature cache for train-head --data.feature_dir")
    p.add_argument("--val-fraction", type=float, default=0.05, help="prompts held out as the cache's val split")
    _add_engine_args(p)
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=cmd_distill)

    from draftheads.training.synthesize import SYNTH_DOMAINS

    p = sub.add_parser("synthesize", help="prompts written by the target itself (Magpie), deduplicated, per domain")
    _add_target_args(p)
    p.add_argument("--out", required=True, help="prompt jsonl ({id, domain, turns}), for distill --prompts")
    p.add_argument("--num-prompts", type=int, default=600, help="prompts to keep, shared equally by the domains")
    p.add_argument("--domains", nargs="+", default=list(SYNTH_DOMAINS))
    p.add_argument("--multi-turn", type=float, default=0.15, help="fraction of prompts given a follow-up turn")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-prompt-tokens", type=int, default=160)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--dedup-threshold", type=float, default=0.7, help="MinHash Jaccard above which prompts are near duplicates")
    p.add_argument("--round-size", type=int, default=192, help="candidates per round (the unit of resume)")
    p.add_argument("--seed", type=int, default=0)
    _add_engine_args(p)
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=cmd_synthesize)

    p = sub.add_parser("cache-features", help="write target hidden states for offline training")
    _add_target_args(p)
    p.add_argument("--data", nargs="+", required=True, help="training jsonl files (as data.train_files)")
    p.add_argument("--layers", default="eagle3", help="eagle3 | eagle | medusa | comma list of HF hidden-state ids")
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-pack", action="store_true")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--out", required=True)
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out even if it holds files this command did not write")
    p.set_defaults(func=cmd_cache_features)

    p = sub.add_parser("profile", help="measure target forward time for K = 1, 2, 4 ... 64 query tokens")
    _add_target_args(p)
    p.add_argument("--ks", default="1,2,4,8,16,32,64")
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=1)
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("export", help="export a head in a format vLLM loads unchanged",
                       description="Formats: vllm-eagle3, speculators (eagle3), vllm-eagle (EAGLE-1, Llama targets), "
                                   "vllm-medusa (vLLM <= 0.32 only: vLLM 0.33 removed Medusa; served as a top-1 chain), "
                                   "vllm-dflash (block drafter; serve with num_speculative_tokens <= block_size - 1), "
                                   "vllm-dspark (DFlash plus Markov and confidence heads; vLLM's V2 model runner).")
    p.add_argument("--head", required=True)
    from draftheads.export.vllm import FORMATS

    p.add_argument("--format", required=True, choices=list(FORMATS))
    p.add_argument("--out", required=True)
    p.add_argument("--verifier", default=None, help="target name or path (written into configs; supplies shared weights)")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out even if it holds files this command did not write")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto", help="where the verifier loads (default auto)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("import", help="import a public Medusa / EAGLE / EAGLE-3 / speculators / DFlash / DSpark checkpoint")
    from draftheads.export.imports import SOURCES

    p.add_argument("--from", dest="source", required=True, choices=list(SOURCES))
    p.add_argument("src", help="checkpoint directory or weight file")
    p.add_argument("--out", required=True)
    p.add_argument("--target-layers", type=int, default=None, help="target layer count, when the checkpoint omits aux ids")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out even if it holds files this command did not write")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("eval", help="acceptance (tau, alpha) and speedup per domain, plain vs speculative")
    _add_target_args(p)
    p.add_argument("--head", default=None)
    p.add_argument("--proposer", default=None, help="head-less proposer: ngram")
    p.add_argument("--prompts", nargs="+", default=["bundled:eval"],
                   help="prompt files (project jsonl, Spec-Bench/MT-bench, GSM8K, HumanEval) or bundled:eval")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--limit-per-domain", type=int, default=None)
    p.add_argument("--tree", default="auto,chain3",
                   help="comma list of modes, each measured against the same plain run: auto (plain or a tree "
                        "each step, by measured speed), chainK (vLLM serves a chain of K), small | medium | large "
                        "(trees) or a static-tree file (Medusa)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_eval, argv=None)

    p = sub.add_parser("bench", help="verify curve, proposer speeds, batch sweep and loss memory, side by side")
    _add_target_args(p)
    from draftheads.heads import FAMILIES

    for name in FAMILIES:  # each head given is timed in the tree mode asked for and as a chain of 3
        p.add_argument(f"--{name}", default=None, help=f"a {name} head directory")
    p.add_argument("--prompts", default="bundled:eval")
    p.add_argument("--limit-per-domain", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-tokens", type=int, default=32, help="new tokens per row in the batch sweep")
    p.add_argument("--batches", default="1,2,4,8,16")
    p.add_argument("--batch-repeats", type=int, default=3,
                   help="interleaved plain/speculative pairs per batch size (more pairs resolve smaller differences)")
    p.add_argument("--tree", default="auto", help="mode of each head beside chain3: auto (default) or a tree")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--datagen-batch", type=int, default=64, help="batch of the datagen part (2x as many prompts)")
    p.add_argument("--lm-head-check", action="store_true",
                   help="proposers part: also time the first head on a fixed tree with the full lm_head projection")
    p.add_argument("--only", default=None, help="comma list of: verify, proposers, batch, memory, datagen")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_bench, argv=None)
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
    args = build_parser().parse_args(argv)
    if hasattr(args, "argv"):
        args.argv = argv
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if not args.verbose:
        _quiet_progress_bars()
    try:
        return args.func(args)
    except DraftheadsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
