"""A stand-in for draftheads/vllm_runner.py with the same JSON-lines protocol, generating with the project's
own engine (greedy or seeded sampling), and answering like vLLM does for ``stop_token_ids``: the stop token
is left out of ``token_ids`` and given as ``stop_reason``."""

import json
import sys

from draftheads.vllm_runner import parse_args, protocol_channel


def main() -> None:
    args = parse_args()
    proto = protocol_channel()

    from draftheads.inference.engine import Engine
    from draftheads.inference.sampling import SamplingParams
    from draftheads.targets import load_target

    model = load_target(args.model, dtype=args.dtype).model
    proto.write(json.dumps({"ready": True, "vllm_version": "fake"}) + "\n")
    for line in sys.stdin:
        msg = json.loads(line)
        for r in msg["requests"]:
            engine = Engine(model, eos_token_ids=r["stop_token_ids"])
            sp = SamplingParams(temperature=r["temperature"], top_p=r["top_p"], top_k=r["top_k"], seed=r["seed"],
                                max_new_tokens=r["max_tokens"])
            (out,) = engine.generate([r["prompt_token_ids"]], sp)
            ids, reason = list(out.token_ids), out.finish_reason
            stop = ids.pop() if reason == "stop" else None
            proto.write(json.dumps({"key": r["key"], "token_ids": ids, "finish_reason": reason,
                                    "stop_reason": stop}) + "\n")
        proto.write(json.dumps({"round_done": msg["round"], "seconds": 0.0, "tokens": 0}) + "\n")


if __name__ == "__main__":
    main()
