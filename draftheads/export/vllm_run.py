"""vLLM side of the serve check (``draftheads serve-check``): greedy generation with or without an exported head.

Runs inside `.venv-vllm` (vLLM's own pins), so it imports only the standard library and vLLM.
Prompts arrive as token ids so both engines see exactly the same input. One request at a time
(batch 1), after one warm-up request, and timed per request.

    python draftheads/export/vllm_run.py --target DIR --prompts prompts.json --max-tokens 64 \
        [--method eagle3 --draft DIR --k 3] --out result.json
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def counters(llm) -> dict:
    """vLLM's speculative-decoding counters (names without the ``vllm:spec_decode_`` prefix)."""
    out = {}
    for m in llm.get_metrics():
        if not m.name.startswith("vllm:spec_decode_"):
            continue
        key = m.name[len("vllm:spec_decode_"):]
        out[key] = list(m.values) if hasattr(m, "values") else m.value
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--prompts", required=True, help="json list of token-id lists")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--method", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--loader-extra", default=None, help="json for model_loader_extra_config")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    # Run as a script, this file's folder comes first on sys.path, where the sibling vllm.py would shadow vLLM.
    sys.path[:] = [d for d in sys.path if os.path.abspath(d or os.curdir) != HERE]
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = None
    if args.method:
        spec = {"method": args.method, "model": args.draft, "num_speculative_tokens": args.k}
    t0 = time.perf_counter()
    llm = LLM(model=args.target, tokenizer=args.target, dtype="float32", max_model_len=args.max_model_len,
              seed=0, speculative_config=spec, disable_log_stats=False,
              model_loader_extra_config=json.loads(args.loader_extra) if args.loader_extra else {})
    start_s = time.perf_counter() - t0
    prompts = json.load(open(args.prompts))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=False)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:16])], SamplingParams(temperature=0.0, max_tokens=4),
                 use_tqdm=False)
    before = counters(llm)
    rows = []
    for ids in prompts:
        t = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        wall = time.perf_counter() - t
        comp = out.outputs[0]
        rows.append({"token_ids": list(comp.token_ids), "text": comp.text, "wall_s": wall})
    after = counters(llm)
    diff = {}
    for k, v in after.items():
        b = before.get(k, [0] * len(v) if isinstance(v, list) else 0)
        diff[k] = [x - y for x, y in zip(v, b)] if isinstance(v, list) else v - b
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"vllm_version": vllm.__version__, "spec": spec, "engine_start_s": start_s, "rows": rows, "counters": diff}, f)
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
