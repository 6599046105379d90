"""vLLM side of ``distill --engine vllm``: a long-lived generator speaking JSON lines.

Runs inside vLLM's own environment (``.venv-vllm``: vLLM pins its own transformers), so it imports only
the standard library and vLLM, and is started by file path, never imported by draftheads.

    python vllm_runner.py --model DIR [--dtype float32] [--max-model-len N] [--tensor-parallel-size N]
                          [--data-parallel-size N] [--seed 0]

Protocol (one JSON object per line; library output goes to stderr, the protocol keeps stdout):

* runner -> client, once: ``{"ready": true, "vllm_version": "..."}``
* client -> runner, one line per round: ``{"round": r, "requests": [{"key", "prompt_token_ids",
  "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids"}, ...]}``
* runner -> client: one ``{"key", "token_ids", "finish_reason", "stop_reason"}`` per request, then
  ``{"round_done": r, "seconds": s, "tokens": n}``
* end of input: the runner exits.
"""

import argparse
import json
import os
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def protocol_channel():
    """The original stdout as the protocol's line-buffered channel; fd 1 then points at stderr, so
    everything libraries print goes there."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return proto


def main() -> None:
    args = parse_args()
    proto = protocol_channel()

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {}
    if args.tensor_parallel_size > 1:
        kw["tensor_parallel_size"] = args.tensor_parallel_size
    if args.data_parallel_size > 1:
        kw["data_parallel_size"] = args.data_parallel_size
    llm = LLM(model=args.model, tokenizer=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              seed=args.seed, **kw)
    proto.write(json.dumps({"ready": True, "vllm_version": vllm.__version__}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        reqs = msg["requests"]
        t0 = time.perf_counter()
        prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in reqs]
        params = [SamplingParams(max_tokens=r["max_tokens"], temperature=r["temperature"], top_p=r["top_p"],
                                 top_k=r.get("top_k", 0), seed=r["seed"], stop_token_ids=r["stop_token_ids"], ignore_eos=False,
                                 skip_special_tokens=True) for r in reqs]
        outs = llm.generate(prompts, params, use_tqdm=False) if reqs else []
        tokens = 0
        for r, out in zip(reqs, outs):
            comp = out.outputs[0]
            tokens += len(comp.token_ids)
            proto.write(json.dumps({"key": r["key"], "token_ids": list(comp.token_ids),
                                    "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason}) + "\n")
        proto.write(json.dumps({"round_done": msg["round"], "seconds": time.perf_counter() - t0,
                                "tokens": tokens}) + "\n")


if __name__ == "__main__":
    main()
