"""The data engines side by side: the same prompts distilled at T = 0 by the project's engine and by vLLM.

    python scripts/vllm_distill_check.py [--per-domain 10] [--max-new-tokens 128] [--batch-size 64]
                                         [--out runs/vllm-distill-check]

Runs `draftheads distill` four times on `bundled:train` (``--per-domain`` prompts of each of its six
domains): each engine text only and with ``--features eagle3`` (vLLM's ``extract_hidden_states``; ours
captures in its generation pass). It then reports

* text: conversations identical, and for each one that is not, where the answers first differ and the
  target's top-2 logit gap there (our forward, fp32): a gap near 0 is a near tie that fp differences
  between the engines' kernels may flip;
* speed: new tokens/s of each engine over the same prompts, vLLM's start-up excluded (both timed by
  distill from the first request), one after the other on this machine. vLLM schedules each round's
  requests itself; our engine holds ``--batch-size`` rows (the default 64 holds all 60 prompts, as vLLM
  does);
* features: every captured layer of vLLM's cache against the project's own forward on the same tokens,
  as the largest |difference| over the layer's largest |value|, beside the same measure for our own
  features rounded to the cache's bf16 (the floor any bf16 cache has), and the target's greedy next
  token agreement.

Writes ``results.json`` and ``results.md`` under ``--out``. Needs `.venv-vllm` (`make vllm-check` builds it).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from draftheads.datagen.backends import engines_markdown
from draftheads.evaluation import machine
from draftheads.utils import atomic_write_json, atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
RATE = re.compile(r"distill: (\d+) prompts done; (\d+) new tokens in (\d+) s \(([\d.]+) tok/s")


def distill(out: Path, engine: str, args, features: bool = False) -> dict:
    cmd = [str(BIN / "draftheads"), "distill", "--prompts", "bundled:train", "--limit-per-domain",
           str(args.per_domain), "--max-new-tokens", str(args.max_new_tokens), "--batch-size", str(args.batch_size),
           "--engine", engine, "--out", str(out)]
    if features:
        cmd += ["--features", "eagle3", "--feature-dir", str(out.with_suffix(".features"))]
    if not out.exists():
        print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"vllm-distill-check: {' '.join(cmd)} failed: {r.stderr.strip().splitlines()[-1:]}")
        (out.with_suffix(".log")).write_text(r.stderr)
    m = RATE.search(out.with_suffix(".log").read_text())
    return {"command": "draftheads " + " ".join(cmd[1:]), "prompts": int(m[1]), "new_tokens": int(m[2]),
            "seconds": int(m[3]), "tok_s": float(m[4])}


def records(path: Path) -> dict:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def divergences(target, ours: dict, theirs: dict) -> list[dict]:
    """Where each differing conversation's answers first part, and the target's top-2 gap there."""
    import torch

    from draftheads.prompts import render_chat

    tok, rows = target.tokenizer, []
    for key in sorted(ours):
        a, b = ours[key], theirs[key]
        if a == b:
            continue
        turn = next(i for i, (x, y) in enumerate(zip(a["answers"], b["answers"])) if x != y) \
            if a["answers"][: len(b["answers"])] != b["answers"] else min(len(a["answers"]), len(b["answers"]))
        history = [m for t, ans in zip(a["turns"][:turn], a["answers"][:turn])
                   for m in ({"role": "user", "content": t}, {"role": "assistant", "content": ans})]
        history.append({"role": "user", "content": a["turns"][turn]})
        prefix = tok(render_chat(tok, history, add_generation_prompt=True), add_special_tokens=False).input_ids
        x = tok(a["answers"][turn] if turn < len(a["answers"]) else "", add_special_tokens=False).input_ids
        y = tok(b["answers"][turn] if turn < len(b["answers"]) else "", add_special_tokens=False).input_ids
        at = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        with torch.no_grad():
            logits = target.model(torch.tensor([prefix + x[:at]])).logits[0, -1].float()
        top = logits.topk(2).values
        rows.append({"id": key, "turn": turn, "token": at, "top2_gap": float(top[0] - top[1]),
                     "ours": tok.decode(x[at: at + 4]), "vllm": tok.decode(y[at: at + 4])})
    return rows


def feature_agreement(target, feature_dir: Path) -> dict:
    """Per layer: vLLM's cached features against our own forward, and the bf16 floor; argmax agreement."""
    import torch

    from draftheads.targets import hidden_states
    from draftheads.training.features import FeatureDataset, collate_features

    layers = None
    err: dict[int, list[float]] = {}
    floor: dict[int, list[float]] = {}
    same = total = 0
    for split in ("train", "val"):
        ds = FeatureDataset(feature_dir, split, target=target.info.name)
        layers = layers or list(ds.index["layer_ids"])
        for i in range(len(ds)):
            row = collate_features([ds[i]])
            doc = row["doc_ids"][0]
            for d in doc.unique().tolist():
                if d < 0:
                    continue
                sel = doc == d
                ids = row["input_ids"][0][sel][None]
                ours, logits = hidden_states(target.model, ids, layers, return_logits=True)
                for layer in layers:
                    ref = ours[layer][0].float()
                    scale = ref.abs().max()
                    err.setdefault(layer, []).append(float((row[f"feat_{layer}"][0][sel].float() - ref).abs().max()
                                                         / scale))
                    floor.setdefault(layer, []).append(float((ref.to(torch.bfloat16).float() - ref).abs().max()
                                                           / scale))
                arg = row["target_argmax"][0][sel]
                same += int((arg == logits[0].argmax(-1)).sum())
                total += int(sel.sum())
    return {"layers": layers, "max_rel_err": {str(k): max(v) for k, v in err.items()},
            "bf16_floor": {str(k): max(v) for k, v in floor.items()},
            "argmax_agreement": same / max(total, 1), "tokens": total}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per-domain", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=64, help="our engine's rows; vLLM schedules the requests itself")
    p.add_argument("--out", default="runs/vllm-distill-check")
    args = p.parse_args()
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    speed = {"vllm_features": distill(out / "vllm-features.jsonl", "vllm", args, features=True),
             "vllm": distill(out / "vllm.jsonl", "vllm", args),
             "draftheads": distill(out / "draftheads.jsonl", "draftheads", args),
             "draftheads_features": distill(out / "draftheads-features.jsonl", "draftheads", args, features=True)}
    from draftheads.targets import load_target

    target = load_target("smollm2-135m")
    ours, theirs = records(out / "draftheads.jsonl"), records(out / "vllm.jsonl")
    assert set(ours) == set(theirs)
    featured = records(out / "vllm-features.jsonl")
    ours_featured = records(out / "draftheads-features.jsonl")
    res = {"per_domain": args.per_domain, "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
           "speed": speed,
           "text": {"prompts": len(ours), "identical": sum(ours[k] == theirs[k] for k in ours),
                    "identical_with_capture": sum(theirs[k] == featured[k] for k in ours),
                    "identical_with_capture_ours": sum(ours[k] == ours_featured[k] for k in ours),
                    "divergences": divergences(target, ours, theirs)},
           "features": feature_agreement(target, out / "vllm-features.features")}
    res = {"command": "python scripts/vllm_distill_check.py " + " ".join(sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), **res}
    atomic_write_json(out / "results.json", res)
    text = engines_markdown(res)
    atomic_write_text(out / "results.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
