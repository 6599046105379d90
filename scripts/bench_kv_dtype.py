"""Side by side in one run: continuous batching of the embedded target with feature capture, as distill
runs it, in bfloat16 with float32 K/V (the engine's choice on a CPU), bfloat16 with bfloat16 K/V, and
float32. Prints tokens/s per configuration and writes JSON to --out.

    python scripts/bench_kv_dtype.py [--prompts 64] [--max-new-tokens 160] [--batch 64] [--out FILE]
"""

import argparse
import json
import time

import torch

from draftheads.datagen.batching import ContinuousBatcher, Conversation
from draftheads.inference.engine import Engine, EngineConfig
from draftheads.inference.sampling import SamplingParams
from draftheads.prompts import encode_chat, load_prompts
from draftheads.targets import load_target

CONFIGS = (("bfloat16", None), ("bfloat16", "bfloat16"), ("float32", None))  # (target dtype, kv_dtype)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64, help="bundled train prompts (first turns)")
    ap.add_argument("--max-new-tokens", type=int, default=160, help="tokens per answer (no stop at end of turn)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = load_prompts("bundled:train")[: args.prompts]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, stop_at_eos=False)
    res = {"threads": torch.get_num_threads(), "prompts": len(rows), "max_new_tokens": args.max_new_tokens,
           "batch": args.batch, "runs": []}
    for dtype, kv in CONFIGS:
        target = load_target("smollm2-135m", dtype=dtype)
        engine = Engine(target.model, target.tokenizer, None, config=EngineConfig(kv_dtype=kv))
        prompts = [encode_chat(target.tokenizer, [{"role": "user", "content": p.turns[0]}]) for p in rows]
        batcher = ContinuousBatcher(engine, args.batch, max_seq_len=1024, capture=(2, 15, 27))
        t0 = time.perf_counter()
        tokens = sum(len(f.answers[0]) for f in batcher.run(Conversation(i, [x], params) for i, x in enumerate(prompts)))
        seconds = time.perf_counter() - t0
        run = {"dtype": dtype, "kv_dtype": str(engine.kv_dtype).removeprefix("torch."), "tokens": tokens,
               "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1)}
        res["runs"].append(run)
        print(f"target {dtype}, K/V {run['kv_dtype']}: {tokens} tokens in {seconds:.1f} s = {run['tokens_per_s']} tok/s",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
