"""Peak memory and time of plain vs fused/chunked vocabulary losses (target: fused <= 30 % of plain).

    .venv/bin/python scripts/bench_loss_memory.py [--tokens 4096] [--out runs/bench/loss_memory.json]
"""

import argparse
import json
import sys
from pathlib import Path

from draftheads.bench.loss_memory import run, table

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=4096)
ap.add_argument("--out", default="runs/bench/loss_memory.json")
args = ap.parse_args()
res = run(tokens=args.tokens, progress=lambda m: print(m, file=sys.stderr, flush=True))
res["command"] = "python scripts/bench_loss_memory.py " + " ".join(sys.argv[1:])
Path(args.out).parent.mkdir(parents=True, exist_ok=True)
Path(args.out).write_text(json.dumps(res, indent=2))
print(table(res))
