"""GPU check: kernel parity tests on CUDA, paged tree attention timings, engine end to end on a
random-weight Llama-3-8B-shaped target with synthetic acceptance. `--cpu`: a dry run of every step
on tiny shapes (interpreter-mode kernels, tiny target), without CUDA timings.

    bash scripts/gpu_check.sh [--cpu]      # writes under $OUT (default runs/gpu-check)
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("--cpu", action="store_true", help="dry run on CPU with tiny shapes")
args = ap.parse_args()
out = Path(os.environ.get("OUT") or "runs/gpu-check")
out.mkdir(parents=True, exist_ok=True)
log = open(out / "log.txt", "w")


def say(msg):
    print(msg, flush=True)
    log.write(msg + "\n")
    log.flush()


import torch  # noqa: E402

have = {m: importlib.util.find_spec(m) is not None for m in ("triton", "transformers", "liger_kernel", "gguf", "lightning")}
cuda = torch.cuda.is_available()
say(f"torch {torch.__version__}, cuda {cuda}{' ' + torch.cuda.get_device_name(0) if cuda else ''}; packages {have}")
if not args.cpu and not cuda:
    say("no CUDA device: run with --cpu for the dry run")
    sys.exit(2)
if not have["triton"] or not have["transformers"]:
    say("triton and transformers are required; install the project first")
    sys.exit(2)
device = "cpu" if args.cpu else "cuda"
results = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": torch.cuda.get_device_name(0) if cuda and not args.cpu
           else "cpu (dry run)", "packages": have}

# 1. kernel parity tests (compiled on CUDA, interpreter on CPU)
env = dict(os.environ, TRITON_INTERPRET="1" if args.cpu else "0", WANDB_MODE="offline", HF_HUB_OFFLINE="1")
t0 = time.time()
r = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/kernels", "-p", "no:cacheprovider"],
                   env=env, capture_output=True, text=True)
results["kernel_tests"] = {"returncode": r.returncode, "tail": r.stdout.strip().splitlines()[-1:], "seconds": time.time() - t0}
say(f"kernel parity tests: {r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-300:]}")

# 2. paged tree attention timings
from draftheads.bench.kernels import bench_attention, bench_engine  # noqa: E402

if args.cpu:
    att = bench_attention("cpu", batches=(1, 2), trees=(4,), contexts=(32,), heads=4, kv_heads=2, dim=64,
                          dtype=torch.float32, repeats=1, progress=say)
else:
    att = bench_attention("cuda", progress=say)
results["attention"] = att

# 3. engine end to end on a random-weight Llama target with synthetic acceptance
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

if args.cpu:
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=1024)
    batches, new = (1, 2), 8
else:  # Llama-3-8B shape
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)
    batches, new = (1, 8, 32), 64
with torch.device(device):
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32 if args.cpu else torch.bfloat16).eval()
if args.cpu:  # interpreter-mode kernels would make the engine crawl; the torch path is what CPU runs
    os.environ["TRITON_INTERPRET"] = "1"
results["engine"] = bench_engine(model, batches=batches, new_tokens=new, prompt_len=32 if args.cpu else 128, progress=say)

(out / "results.json").write_text(json.dumps(results, indent=2, default=str))
say("")
say(f"| check | result |\n|---|---|\n| kernel tests | {results['kernel_tests']['tail']} |")
say(f"| copy bandwidth | {att['copy_gbps']:.0f} GB/s |")
for row in att["rows"]:
    say(f"| attention b={row['batch']} tree={row['tree']} ctx={row['context']} | triton {row['triton_ms']:.3f} ms, "
        f"torch {row['torch_ms']:.3f} ms, {row['fraction_of_copy_bw']:.0%} of copy bw |")
for b, e in results["engine"].items():
    say(f"| engine batch {b} | plain {e['plain_tok_s']:.1f} tok/s, spec {e['spec_tok_s']:.1f} tok/s, tau {e['tau']:.2f}, "
        f"{e['speedup']:.2f}x |")
