"""A stand-in for draftheads/datagen/vllm_runner.py with the same JSON-lines protocol, generating with the project's
own engine (greedy or seeded sampling), and answering like vLLM does for ``stop_token_ids``: the stop token
is left out of ``token_ids`` and given as ``stop_reason``. With ``--capture`` it writes hidden-states files
in vLLM's layout and convention (id i = the residual stream after layer i, so the last id is before the
final norm) for ``"features"`` requests."""

import json
import os
import sys

from draftheads.datagen.vllm_runner import parse_args, protocol_channel


def _vllm_hidden_states(model, ids, layers):
    """[T, len(layers), H] at vLLM's aux ids, and the target's greedy next token after each position."""
    import torch

    from draftheads.targets import decoder_parts

    embed, blocks, _ = decoder_parts(model)
    modules = {0: embed, **{i: blocks[i - 1] for i in range(1, len(blocks) + 1)}}
    found = {}
    hooks = [modules[i].register_forward_hook(
        lambda _m, _a, out, i=i: found.__setitem__(i, out[0] if isinstance(out, tuple) else out)) for i in layers]
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    finally:
        for h in hooks:
            h.remove()
    hidden = torch.stack([found[i].reshape(len(ids), -1) for i in layers], dim=1)
    return hidden.float().contiguous(), logits.argmax(-1).tolist()


def main() -> None:
    args = parse_args()
    proto = protocol_channel()

    import torch
    from safetensors.torch import save_file

    from draftheads.inference.engine import Engine
    from draftheads.inference.sampling import SamplingParams
    from draftheads.targets import load_target

    model = load_target(args.model, dtype=args.dtype).model
    layers = [int(x) for x in args.capture.split(",")] if args.capture else []
    proto.write(json.dumps({"ready": True, "vllm_version": "fake"}) + "\n")
    for line in sys.stdin:
        msg = json.loads(line)
        for r in msg["requests"]:
            if r.get("features"):
                hidden, argmax = _vllm_hidden_states(model, r["prompt_token_ids"], layers)
                path = os.path.join(args.capture_dir, f"{r['key']}-{msg['round']}.safetensors")
                save_file({"hidden_states": hidden, "token_ids": torch.tensor(r["prompt_token_ids"])}, path)
                proto.write(json.dumps({"key": r["key"], "token_ids": [argmax[-1]], "finish_reason": "length",
                                        "stop_reason": None, "hidden_states_path": path, "argmax": argmax}) + "\n")
                continue
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
