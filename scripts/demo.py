"""`make demo`: the main job on the embedded default target (SmolLM2-135M-Instruct), under runs/demo/.

    distill (answers and their features, one pass) -> train-head fit (EAGLE-3) -> export (vllm-eagle3) -> eval
    (the head trained now, and the shipped reference head when it is installed, on the same prompts)

Each stage runs the project's own command (printed before it runs) and leaves its output in
runs/demo/; a second run reuses finished stages. `--redo STAGE,...` (or `--redo all`) runs them
again; an interrupted training run resumes from its last checkpoint.

    python scripts/demo.py [--redo all|distill,train,export,eval] [--per-domain 8]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = Path("runs/demo")
STAGES = ("distill", "train", "export", "eval")
BIN = Path(sys.executable).parent


def run(stage: str, cmd: list[str]) -> float:
    print(f"\n=== {stage}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.call(cmd, cwd=ROOT)
    if rc != 0:
        sys.exit(f"demo: stage {stage} failed (exit {rc}); fix the error above and rerun `make demo` "
                 "(finished stages are kept)")
    took = time.perf_counter() - t0
    print(f"=== {stage}: done in {took:.0f} s", flush=True)
    return took


def train_config(args) -> Path:
    """configs/smollm2-eagle3-demo.yaml with every path moved under runs/demo/ and a shorter schedule."""
    from draftheads.training.cli import config_under, save_config

    base = "configs/smollm2-eagle3-demo.yaml"
    cfg = config_under(ROOT / base, RUN, RUN / "features", trainer={"max_epochs": args.epochs, "max_time": "00:00:06:00"},
                       model={"warmup_ratio": 0.05})
    for logger in cfg["trainer"]["logger"]:
        if logger["class_path"].endswith("WandbLogger"):
            logger["init_args"]["name"] = "smollm2-eagle3-make-demo"
    for cb in cfg["trainer"]["callbacks"]:
        if cb["class_path"].endswith("ModelCheckpoint"):
            cb["init_args"]["every_n_train_steps"] = 10
    return save_config(cfg, RUN / "train.yaml", f"{base} by scripts/demo.py")


SHIPPED = ROOT / "draftheads/data/heads/smollm2-135m-eagle3"


def reference_installed() -> bool:
    return (SHIPPED / "model.safetensors").is_file() and (SHIPPED / "card.json").is_file()


def answer_tokens(features: Path) -> int:
    from draftheads.training.features import FeatureDataset

    return sum(int(m.sum()) for m in FeatureDataset(features, "train").column("loss_mask"))


def head_rows(rows: list[tuple[str, Path]]) -> str:
    """One line per head and eval mode: tau, alpha@1 and speedup over all demo eval prompts."""
    lines = ["| head | mode | τ | α@1 | speedup |", "|---|---|---|---|---|"]
    for label, where in rows:
        for mode, m in json.loads((where / "results.json").read_text())["modes"].items():
            o = m["overall"]
            a1 = o["alpha"][0] if o["alpha"] else 0.0
            lines.append(f"| {label} | {mode} | {o['tau']:.2f} | {a1:.2f} | {o['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--redo", default="", help="comma list of stages to run again, or all")
    p.add_argument("--per-domain", type=int, default=8, help="train prompts per domain to distill")
    p.add_argument("--max-new-tokens", type=int, default=128, help="answer length when distilling")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--eval-per-domain", type=int, default=2)
    p.add_argument("--eval-tokens", type=int, default=64)
    args = p.parse_args()
    redo = set(STAGES) if args.redo == "all" else {s for s in args.redo.split(",") if s}
    unknown = redo - set(STAGES)
    if unknown:
        sys.exit(f"demo: --redo {sorted(unknown)} unknown: use all or some of {','.join(STAGES)}")
    for s in STAGES[min((STAGES.index(s) for s in redo), default=len(STAGES)):]:
        redo.add(s)  # a redone stage invalidates the ones after it

    dh, th = str(BIN / "draftheads"), str(BIN / "train-head")
    data, features, head = RUN / "data/train.jsonl", RUN / "features", RUN / "head"
    export, evald = RUN / "export", RUN / "eval"
    outputs = {"distill": data, "train": head, "export": export, "eval": evald / "results.json"}
    for s in redo:
        target = ROOT / outputs[s]
        if s == "distill":
            shutil.rmtree(ROOT / features, ignore_errors=True)
        if s == "train":
            shutil.rmtree(ROOT / RUN / "train", ignore_errors=True)
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    t0, times = time.perf_counter(), {}

    def stage(name: str, cmd: list[str]) -> None:
        if (ROOT / outputs[name]).exists():
            print(f"=== {name}: reusing {outputs[name]} (--redo {name} to run it again)", flush=True)
            return
        times[name] = run(name, cmd)

    stage("distill", [dh, "distill", "--prompts", "bundled:train", "--limit-per-domain", str(args.per_domain),
                      "--max-new-tokens", str(args.max_new_tokens), "--batch-size", str(6 * args.per_domain),
                      "--features", "eagle3", "--feature-dir", str(features), "--max-seq-len", "512",
                      "--val-fraction", "0.1", "--out", str(data)])
    cmd = [th, "fit", "--config", str(train_config(args))]
    if (ROOT / RUN / "train/checkpoints/last.ckpt").exists():
        cmd += ["--ckpt_path", "last"]
    stage("train", cmd)
    stage("export", [dh, "export", "--head", str(head), "--format", "vllm-eagle3", "--out", str(export),
                     "--verifier", "smollm2-135m"])
    eval_args = ["--prompts", "bundled:eval", "--limit-per-domain", str(args.eval_per_domain), "--max-new-tokens",
                 str(args.eval_tokens), "--tree", "auto,chain3"]
    stage("eval", [dh, "eval", "--head", str(head), *eval_args, "--out", str(evald)])
    reference = evald.parent / "eval-reference"
    if reference_installed() and not (ROOT / reference / "results.json").exists():
        times["eval reference"] = run("eval reference", [dh, "eval", "--head", "reference", *eval_args,
                                                         "--out", str(reference)])

    print("\n" + (ROOT / evald / "results.md").read_text())
    rows = [(f"trained now on {answer_tokens(ROOT / features) / 1e3:.1f} k tokens", ROOT / evald)]
    if (ROOT / reference / "results.json").exists():
        card = json.loads((SHIPPED / "card.json").read_text())
        rows.append((f"reference, trained on {trained_tokens(card)} tokens", ROOT / reference))
    print(head_rows(rows))
    plots = sorted(str(f.relative_to(ROOT)) for f in (ROOT / evald).glob("*.png"))
    print("plots: " + ", ".join(plots))
    print(f"head: {head}   vLLM export: {export}   stage times: "
          + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()) + f"   total {time.perf_counter() - t0:.0f} s")
    return 0


def trained_tokens(card: dict) -> str:
    """The answer tokens a packaged head was trained on, run by run over its lineage ("1,014,736 + 979,874")."""
    runs = card.get("lineage") or []
    if runs and all(r.get("answer_tokens") for r in runs):
        return " + ".join(f"{r['answer_tokens']:,}" for r in runs)
    return f"{card['data']['train']['answer_tokens']:,}"


if __name__ == "__main__":
    sys.exit(main())
