"""Side by side in one run: the attention of EAGLE-3's training-time test step j, forward and backward,
as one SDPA over (j + 1) x T keys with diagonal own-position blocks in its mask
(``layers.masked_own_attention``), against ``layers.prefix_and_own_attention`` (blocks of query rows,
each reading the prefix keys its rows can see and its own rows of the earlier steps). SmolLM2's head shapes (9 query heads, 3 K/V heads, head
size 64), rows of --tokens tokens holding three documents. Then the whole training-time test of an
EAGLE-3 head of SmolLM2's shapes (--ttt-steps steps, draft vocabulary 8k, forward and backward) with
either attention in its layer. Prints seconds per call and the largest differences, and writes JSON to
--out."""

import argparse
import json
import statistics
import time

import torch

from draftheads.heads import Eagle3Config, Eagle3Head, LayerSpec, layers
from draftheads.heads.layers import masked_own_attention, prefix_and_own_attention


def whole_ttt(mask, dtype, rows, tokens, steps, repeats):
    """Seconds of one training-time test, forward and backward, with each attention, and the largest
    gradient difference."""
    spec = LayerSpec(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                     head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config(layer=spec, vocab_size=49152, draft_vocab_size=8192,
                                   aux_layer_ids=(2, 15, 27), target_hidden_size=576, ttt_steps=steps))
    aux, emb = torch.randn(rows, tokens, 3 * 576), torch.randn(rows, tokens, 576)
    pos = torch.arange(tokens).expand(rows, tokens)
    autocast = dict(device_type="cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)

    def run():
        head.zero_grad()
        with torch.autocast(**autocast):
            loss = sum(o.float().pow(2).mean() for o in head.ttt(aux, lambda j: emb, pos, mask.float()))
        loss.backward()
        return [p.grad.clone() for p in head.parameters() if p.grad is not None]

    seconds, grads = {}, {}
    for name, fn in (("masked", masked_own_attention), ("prefix_and_own", prefix_and_own_attention)):
        layers.prefix_and_own_attention = fn  # the name DraftAttention calls
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            grads[name] = run()
            times.append(time.perf_counter() - t0)
        seconds[name] = statistics.median(times[1:])
    layers.prefix_and_own_attention = prefix_and_own_attention
    diff = max((a - b).abs().max().item() for a, b in zip(grads["masked"], grads["prefix_and_own"]))
    return {**seconds, "speedup": seconds["masked"] / seconds["prefix_and_own"], "max_grad_diff": diff}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ttt-steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    b, t, h, kvh, d = args.rows, args.tokens, 9, 3, 64
    g = torch.Generator().manual_seed(0)
    doc = torch.arange(t) * 3 // t  # three documents a row
    pos = torch.arange(t)
    seen = (doc[:, None] == doc[None]) & (pos[:, None] >= pos[None])
    mask = torch.zeros(t, t, dtype=dtype).masked_fill(~seen, float("-inf")).expand(b, 1, t, t)
    leaf = lambda heads: torch.randn(b, heads, t, d, generator=g).to(dtype).requires_grad_()  # noqa: E731
    out = []
    for j in range(1, 5):
        q, prefix = leaf(h), (leaf(kvh), leaf(kvh))
        own = ([leaf(kvh) for _ in range(j)], [leaf(kvh) for _ in range(j)])
        seconds, results = {}, {}
        for name, fn in (("masked", masked_own_attention), ("prefix_and_own", prefix_and_own_attention)):
            times = []
            for _ in range(args.repeats + 1):  # the first call warms up
                t0 = time.perf_counter()
                results[name] = fn(q, prefix, own, mask)
                results[name].float().sum().backward()
                times.append(time.perf_counter() - t0)
            seconds[name] = statistics.median(times[1:])
        diff = (results["masked"].float() - results["prefix_and_own"].float()).abs().max().item()
        out.append({"step": j, **seconds, "speedup": seconds["masked"] / seconds["prefix_and_own"], "max_diff": diff})
        print(f"step {j}: masked {seconds['masked']:.2f} s, prefix_and_own {seconds['prefix_and_own']:.2f} s "
              f"({out[-1]['speedup']:.2f}x), max difference {diff:.1e}")
    ttt = whole_ttt(mask, dtype, b, t, args.ttt_steps, args.repeats)
    print(f"training-time test, {args.ttt_steps} steps: masked {ttt['masked']:.2f} s, prefix_and_own "
          f"{ttt['prefix_and_own']:.2f} s ({ttt['speedup']:.2f}x), max gradient difference {ttt['max_grad_diff']:.1e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**vars(args), "threads": torch.get_num_threads(), "steps": out, "ttt": ttt}, f, indent=1)


if __name__ == "__main__":
    main()
