"""``draftheads`` command line: one subcommand per job. Bad input ends in one ``error:`` line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from draftheads.errors import DraftheadsError
from draftheads.targets import DEFAULT_TARGET


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target spec (default {DEFAULT_TARGET})")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom modeling code from the hub")


def cmd_info(args) -> int:
    from draftheads.targets import load_target

    info = load_target(args.target, dtype=args.dtype, trust_remote_code=args.trust_remote_code).info
    d = {k: (str(v) if k == "dtype" else v) for k, v in info.__dict__.items()}
    print(json.dumps(d, indent=2))
    return 0


def cmd_generate(args) -> int:
    import torch

    from draftheads.prompts import render_chat
    from draftheads.targets import load_target

    if args.max_new_tokens < 1:
        raise DraftheadsError(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    target = load_target(args.target, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    tok = target.tokenizer
    text = render_chat(tok, [{"role": "user", "content": args.prompt}], name=args.target)
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    out = target.model.generate(
        ids, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.eos_token_id
    )
    dt = time.perf_counter() - t0
    new = out[0, ids.shape[1]:]
    print(tok.decode(new, skip_special_tokens=True))
    print(f"[{len(new)} tokens in {dt:.2f} s = {len(new) / dt:.1f} tok/s, HF generate, greedy]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftheads", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="load a target and print its TargetInfo")
    _add_target_args(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("generate", help="answer one prompt greedily and report tokens/s")
    _add_target_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_generate)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return args.func(args)
    except DraftheadsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
