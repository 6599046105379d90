"""vLLM side of ``distill --engine vllm``: a long-lived generator speaking JSON lines.

Runs inside vLLM's own environment (``.venv-vllm``: vLLM pins its own transformers), so it imports only
the standard library and vLLM (vLLM only inside :func:`main`), and is started by file path; draftheads
imports only its standard-library helpers (arguments, protocol channel, the hidden-states file lock).

    python vllm_runner.py --model DIR [--dtype float32] [--max-model-len N] [--tensor-parallel-size N]
                          [--data-parallel-size N] [--pipeline-parallel-size N]
                          [--distributed-executor-backend mp|ray] [--seed 0]
                          [--capture 2,15,27,30 --capture-dir DIR]

Protocol (one JSON object per line; library output goes to stderr, the protocol keeps stdout):

* runner -> client, once: ``{"ready": true, "vllm_version": "..."}``
* client -> runner, one line per round: ``{"round": r, "requests": [{"key", "prompt_token_ids",
  "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids"}, ...]}``
* runner -> client: one ``{"key", "token_ids", "finish_reason", "stop_reason"}`` per request, then
  ``{"round_done": r, "seconds": s, "tokens": n}``
* end of input: the runner exits.

With ``--capture`` vLLM runs its ``extract_hidden_states`` method: the listed layers' hidden states of
every computed token are kept (vLLM's aux-layer ids: 0 = embeddings, i = the residual stream after layer
i, so the last id is *before* the final norm). A request with ``"features": true`` (a prefill of a whole
conversation, ``max_tokens`` 1, greedy) is answered with two more fields: ``hidden_states_path``, a
safetensors file (``hidden_states`` [T, layers, hidden], ``token_ids`` [T]) that the client reads and
removes, and ``argmax`` [T], the target's greedy next token after each position (from prompt logprobs,
the last one the token sampled). Other requests' files are removed here. The hidden states go through
vLLM's example hidden-states connector on CUDA, and through ``vllm_hidden_states.py`` (beside this file:
the same connector with a host copy) where vLLM runs without CUDA.
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
    p.add_argument("--pipeline-parallel-size", type=int, default=1)
    p.add_argument("--distributed-executor-backend", default=None, help="mp | ray (default: vLLM's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--capture", default=None, help="comma list of vLLM aux hidden-state layer ids")
    p.add_argument("--capture-dir", default=None, help="where vLLM writes the hidden-states files")
    return p.parse_args(argv)


def capture_config(layers: list, directory: str, cuda: bool) -> dict:
    """``LLM`` keyword arguments of vLLM's hidden-state extraction for ``layers`` into ``directory``."""
    connector = {"kv_connector": "ExampleHiddenStatesConnector"}
    if not cuda:  # the stock connector copies through CUDA streams and pinned memory
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [sys.path[0], os.environ.get("PYTHONPATH")]))
        connector = {"kv_connector": "HostHiddenStatesConnector", "kv_connector_module_path": "vllm_hidden_states"}
    return {"speculative_config": {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}}},
            "kv_transfer_config": {**connector, "kv_role": "kv_producer",
                                   "kv_connector_extra_config": {"shared_storage_path": directory}}}


def llm_kwargs(args: argparse.Namespace, cuda: bool) -> dict:
    """vLLM ``LLM`` keyword arguments of the runner's command line (parallelism given only when set, so
    vLLM's own defaults hold otherwise)."""
    kw = {"model": args.model, "tokenizer": args.model, "dtype": args.dtype, "max_model_len": args.max_model_len,
          "seed": args.seed}
    for name in ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size"):
        if getattr(args, name) > 1:
            kw[name] = getattr(args, name)
    if args.distributed_executor_backend:
        kw["distributed_executor_backend"] = args.distributed_executor_backend
    if args.capture:
        kw.update(capture_config([int(x) for x in args.capture.split(",")], args.capture_dir, cuda))
    return kw


def wait_for_writer(path: str) -> None:
    """Return once vLLM's connector has finished writing the hidden-states file ``path`` (its writer holds
    an exclusive lock on ``path.lock`` until then), and remove the lock file."""
    import fcntl

    lock = f"{path}.lock"
    if os.path.exists(lock):
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)
        os.remove(lock)


def prompt_argmax(out) -> list:
    """The target's greedy next token after every prompt position (rank-1 prompt logprobs, then the one
    token sampled greedily after the last position)."""
    best = [min(lp.items(), key=lambda kv: kv[1].rank)[0] for lp in out.prompt_logprobs[1:]]
    return best + [out.outputs[0].token_ids[0]]


def protocol_channel():
    """The original stdout as the protocol's line-buffered channel; fd 1 then points at stderr, so
    everything libraries print goes there."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return proto


def main() -> None:
    args = parse_args()
    proto = protocol_channel()

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**llm_kwargs(args, torch.cuda.is_available()))
    proto.write(json.dumps({"ready": True, "vllm_version": vllm.__version__}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        reqs = msg["requests"]
        t0 = time.perf_counter()
        prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in reqs]
        params = [SamplingParams(max_tokens=r["max_tokens"], temperature=r["temperature"], top_p=r["top_p"],
                                 top_k=r.get("top_k", 0), seed=r["seed"], stop_token_ids=r["stop_token_ids"],
                                 ignore_eos=False, skip_special_tokens=True,
                                 prompt_logprobs=1 if r.get("features") else None) for r in reqs]
        outs = llm.generate(prompts, params, use_tqdm=False) if reqs else []
        tokens = 0
        for r, out in zip(reqs, outs):
            comp = out.outputs[0]
            tokens += len(comp.token_ids)
            reply = {"key": r["key"], "token_ids": list(comp.token_ids), "finish_reason": comp.finish_reason,
                     "stop_reason": comp.stop_reason}
            path = (out.kv_transfer_params or {}).get("hidden_states_path")
            if r.get("features"):
                reply.update(hidden_states_path=path, argmax=prompt_argmax(out))
            elif path:  # a generation round's file: nobody reads it
                wait_for_writer(path)
                if os.path.exists(path):
                    os.remove(path)
            proto.write(json.dumps(reply) + "\n")
        proto.write(json.dumps({"round_done": msg["round"], "seconds": time.perf_counter() - t0,
                                "tokens": tokens}) + "\n")


if __name__ == "__main__":
    main()
