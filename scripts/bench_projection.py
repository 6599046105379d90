"""Side by side in one run: x @ weight.T against draftheads' vocab_logits for a few rows (fp32, SmolLM2's
vocabulary and hidden size). Prints milliseconds per call and writes JSON to --out."""

import argparse
import json
import time

import torch

from draftheads.inference.projection import vocab_logits


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    w = torch.randn(args.vocab, args.hidden)
    rows_out = []
    for rows in (1, 2, 5, 12, 64):
        x = torch.randn(rows, args.hidden)
        ms = {}
        for name, fn in (("linear", lambda: torch.nn.functional.linear(x, w)), ("vocab_logits", lambda: vocab_logits(x, w)),  # noqa: B023
                         ("weight_major", lambda: (w @ x.T).T)):  # noqa: B023
            fn()
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                fn()
            ms[name] = (time.perf_counter() - t0) * 1e3 / args.repeats
        rows_out.append({"rows": rows, **ms, "ratio": ms["linear"] / ms["vocab_logits"]})
        print(f"{rows:3d} rows: linear {ms['linear']:.1f} ms, weight-major {ms['weight_major']:.1f} ms, "
              f"vocab_logits {ms['vocab_logits']:.1f} ms, {ms['linear'] / ms['vocab_logits']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"vocab": args.vocab, "hidden": args.hidden, "threads": torch.get_num_threads(), "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
