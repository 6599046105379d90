"""`make demo`: the main job on the embedded default target (SmolLM2-135M-Instruct), under runs/demo/.

    distill -> cache-features -> train-head fit (EAGLE-3) -> export (vllm-eagle3) -> eval

Each stage runs the project's own command (printed before it runs) and leaves its output in
runs/demo/; a second run reuses finished stages. `--redo STAGE,...` (or `--redo all`) runs them
again; an interrupted training run resumes from its last checkpoint.

    python scripts/demo.py [--redo all|distill,features,train,export,eval] [--per-domain 8]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
RUN = Path("runs/demo")
STAGES = ("distill", "features", "train", "export", "eval")
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
    cfg = yaml.safe_load((ROOT / "configs/smollm2-eagle3-demo.yaml").read_text())
    out = RUN / "train"
    cfg["trainer"].update({"default_root_dir": str(out), "max_epochs": args.epochs, "max_time": "00:00:06:00"})
    for logger in cfg["trainer"]["logger"]:
        logger["init_args"]["save_dir"] = str(out)
        if "name" in logger["init_args"] and logger["class_path"].endswith("WandbLogger"):
            logger["init_args"]["name"] = "smollm2-eagle3-make-demo"
    for cb in cfg["trainer"]["callbacks"]:
        if cb["class_path"].endswith("ModelCheckpoint"):
            cb["init_args"].update({"dirpath": str(out / "checkpoints"), "every_n_train_steps": 10})
    cfg["model"]["init_args"].update({"head_dir": str(RUN / "head"), "warmup_steps": 5})
    cfg["data"]["feature_dir"] = str(RUN / "features")
    path = ROOT / RUN / "train.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# written by scripts/demo.py from configs/smollm2-eagle3-demo.yaml\n" + yaml.safe_dump(cfg, sort_keys=False))
    return path.relative_to(ROOT)


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
    outputs = {"distill": data, "features": features, "train": head, "export": export, "eval": evald / "results.json"}
    for s in redo:
        target = ROOT / outputs[s]
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
                      "--out", str(data)])
    stage("features", [dh, "cache-features", "--data", str(data), "--layers", "eagle3", "--max-length", "512",
                       "--val-fraction", "0.1", "--out", str(features)])
    cmd = [th, "fit", "--config", str(train_config(args))]
    if (ROOT / RUN / "train/checkpoints/last.ckpt").exists():
        cmd += ["--ckpt_path", "last"]
    stage("train", cmd)
    stage("export", [dh, "export", "--head", str(head), "--format", "vllm-eagle3", "--out", str(export),
                     "--verifier", "smollm2-135m"])
    stage("eval", [dh, "eval", "--head", str(head), "--prompts", "bundled:eval", "--limit-per-domain",
                   str(args.eval_per_domain), "--max-new-tokens", str(args.eval_tokens), "--tree", "small",
                   "--out", str(evald)])

    print("\n" + (ROOT / evald / "results.md").read_text())
    plots = sorted(str(f.relative_to(ROOT)) for f in (ROOT / evald).glob("*.png"))
    print("plots: " + ", ".join(plots))
    print(f"head: {head}   vLLM export: {export}   stage times: "
          + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()) + f"   total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
