"""Side by side in one run: the attention of EAGLE-3's training-time test step j, forward and backward,
as one SDPA over (j + 1) x T keys with diagonal own-position blocks in its mask
(``layers.masked_own_attention``), against ``layers.prefix_and_own_attention`` (from step 2 on, query
blocks reading the prefix and their own rows). SmolLM2's head shapes (9 query heads, 3 K/V heads, head
size 64), rows of --tokens tokens holding three documents. Prints seconds per call and the largest output
difference, and writes JSON to --out."""

import argparse
import json
import statistics
import time

import torch

from draftheads.heads.layers import masked_own_attention, prefix_and_own_attention


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
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
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**vars(args), "threads": torch.get_num_threads(), "steps": out}, f, indent=1)


if __name__ == "__main__":
    main()
