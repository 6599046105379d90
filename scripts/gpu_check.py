"""GPU check: kernel parity tests on CUDA, paged tree attention timings, engine end to end on a
random-weight Llama-3-8B-shaped target with synthetic acceptance (512-token prompts), sampling at
T = 0.7, Liger's fused losses against the chunked CPU path, 20-step `train-head fit` smokes (EAGLE-3 with DDP
and FSDP, DFlash, DSpark) on a random target with Llama-3-8B's layer shapes (3 layers), and greedy identity
of an oracle and the EAGLE-3, DFlash and DSpark proposers (chains and trees, random heads) on the device in
float32, and DFlash's FlexAttention block mask against the dense SDPA mask (loss, gradients, step time, peak
memory). `--skip STEP,...` leaves steps out (kernels, attention, engine, eagle3, greedy, flex). `--cpu`: a dry run of every
step on tiny shapes (interpreter-mode kernels, tiny target), without CUDA timings; exits 1 when a
check fails.

    bash scripts/gpu_check.sh [--cpu] [--skip STEP,...]     # writes under $OUT (default runs/gpu-check)
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
STEPS = ("kernels", "attention", "engine", "eagle3", "greedy", "flex")
ap.add_argument("--skip", default="", help=f"comma-separated steps to leave out: {', '.join(STEPS)}")
args = ap.parse_args()
skip = {s for s in args.skip.split(",") if s}
if skip - set(STEPS):
    ap.error(f"--skip {args.skip}: only {', '.join(STEPS)} can be left out")
out = Path(os.environ.get("OUT") or "runs/gpu-check")
out.mkdir(parents=True, exist_ok=True)
log = open(out / "log.txt", "w")


def say(msg):
    print(msg, flush=True)
    log.write(msg + "\n")
    log.flush()


import torch  # noqa: E402

have = {m: importlib.util.find_spec(m) is not None for m in ("triton", "transformers", "liger_kernel", "gguf", "lightning",
                                                             "datasets", "jsonargparse")}
cuda = torch.cuda.is_available()
say(f"torch {torch.__version__}, cuda {cuda}{' ' + torch.cuda.get_device_name(0) if cuda else ''}; packages {have}")
if not args.cpu and not cuda:
    say("no CUDA device: run with --cpu for the dry run")
    sys.exit(2)
if not have["triton"] or not have["transformers"]:
    say("triton and transformers are required; install the project first")
    sys.exit(2)
device = "cpu" if args.cpu else "cuda"
results = {"command": " ".join(["bash scripts/gpu_check.sh", *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": torch.cuda.get_device_name(0) if cuda and not args.cpu
           else "cpu (dry run)", "packages": have}

# 1. kernel parity tests (compiled on CUDA, interpreter on CPU)
env = dict(os.environ, TRITON_INTERPRET="1" if args.cpu else "0", WANDB_MODE="offline", HF_HUB_OFFLINE="1")
t0 = time.time()
# the interpreter runs the long-prompt cases for minutes: the dry run leaves the slow-marked ones out
# compiling the kernels' variants is CPU work: on a device machine, in parallel processes (pytest-xdist)
workers = ["-n", "8"] if not args.cpu and importlib.util.find_spec("xdist") else []
r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rf", "--tb=line", "tests/kernels", "-p", "no:cacheprovider",
                    *workers, *(["-m", "not slow"] if args.cpu else [])], env=env, capture_output=True, text=True) \
    if "kernels" not in skip else subprocess.CompletedProcess([], 0, "skipped", "")
lines = r.stdout.strip().splitlines()
failed_lines = [ln for ln in lines if ln.startswith("FAILED") or ln.startswith("E ") or ".py:" in ln][:20]
results["kernel_tests"] = {"returncode": r.returncode, "tail": lines[-1:], "failed": failed_lines,
                           "seconds": time.time() - t0}
say(f"kernel parity tests: {lines[-1] if lines else r.stderr[-300:]}")
for ln in failed_lines:
    say(f"  {ln}")

# 2. paged tree attention timings
from draftheads.bench.kernels import bench_attention, bench_engine  # noqa: E402

if "attention" in skip:
    att = {"skipped": True, "copy_gbps": float("nan"), "rows": []}
elif args.cpu:
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
results["engine"] = {} if "engine" in skip else bench_engine(model, batches=batches, new_tokens=new,
                                                             prompt_len=32 if args.cpu else 512, progress=say)

(out / "results.json").write_text(json.dumps(results, indent=2, default=str))
say("")
say(f"| check | result |\n|---|---|\n| kernel tests | {results['kernel_tests']['tail']} |")
say("| copy bandwidth | skipped |" if att.get("skipped") else f"| copy bandwidth | {att['copy_gbps']:.0f} GB/s |")
for row in att["rows"]:
    say(f"| attention b={row['batch']} tree={row['tree']} ctx={row['context']} | triton {row['triton_ms']:.3f} ms, "
        f"torch {row['torch_ms']:.3f} ms, {row['fraction_of_copy_bw']:.0%} of copy bw |")
for b, e in results["engine"].items():
    say(f"| engine batch {b} | plain {e['plain_tok_s']:.1f} tok/s, spec {e['spec_tok_s']:.1f} tok/s, tau {e['tau']:.2f}, "
        f"{e['speedup']:.2f}x |")

# 4. sampling at T = 0.7 on the device: real rejection sampling, and the same seed gives the same output
from draftheads.inference.engine import Engine  # noqa: E402
from draftheads.inference.proposers.random_draft import RandomProposer  # noqa: E402
from draftheads.inference.sampling import SamplingParams  # noqa: E402

vocab = cfg.vocab_size
prompts = [torch.randint(vocab, (32 if args.cpu else 512,)).tolist() for _ in range(2)]
sp = SamplingParams(temperature=0.7, max_new_tokens=new, seed=7, stop_at_eos=False)
engine = Engine(model, proposer=RandomProposer(vocab), tree="chain3")
first, again = engine.generate(prompts, sp), engine.generate(prompts, sp)
results["sampling"] = {"temperature": 0.7, "rows": len(prompts), "new_tokens": new,
                       "same_seed_same_output": all(a.token_ids == b.token_ids for a, b in zip(first, again)),
                       "tau": sum(o.metrics.tau for o in first) / len(first)}
say(f"sampling T=0.7: same seed, same output: {results['sampling']['same_seed_same_output']}")
del model, engine
if cuda:
    torch.cuda.empty_cache()

# 5. fused losses: Liger's kernels on the device against the chunked torch path on CPU, values and grads
from draftheads.bench.parity import flex_vs_sdpa, loss_parity  # noqa: E402
from draftheads.training.losses import linear_cross_entropy, linear_kl  # noqa: E402

if have["liger_kernel"]:
    n, hidden, v = (64, 32, 300) if args.cpu else (4096, 4096, 32000)
    results["losses"] = {name: loss_parity(name, fn, n, hidden, v, device) for name, fn in
                         (("cross_entropy", linear_cross_entropy), ("kl", lambda hs, ws, ht, wt, impl:
                                                                     linear_kl(hs, ws, ht, wt, impl=impl)))}
    for name, r in results["losses"].items():
        say(f"loss {name}: liger {r['liger']:.6f} vs chunked {r['chunked']:.6f} (rel {r['loss_rel']:.1e}); "
            f"grads rel {r['grad_h_rel']:.1e} / {r['grad_w_rel']:.1e}")
else:
    results["losses"] = {"skipped": "liger-kernel is not installed"}
    say("losses: liger-kernel is not installed, skipped")

# 6. train-head fit: 20 steps on one device with DDP and with FSDP (FSDP refuses a CPU accelerator)
import yaml  # noqa: E402

from draftheads.testing import save_tiny_llama  # noqa: E402

work = out / "train"
shape = {} if args.cpu else {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 3,
                             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                             "max_position_embeddings": 8192}
target_dir = save_tiny_llama(work / "target", dtype=torch.float32 if args.cpu else torch.bfloat16, **shape)
rows = [{"messages": [{"role": "user", "content": f"What is {i} plus {i + 1}?"},
                      {"role": "assistant", "content": f"The answer is {2 * i + 1}. The quick brown fox jumps."}]}
        for i in range(64)]
(work / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
results["train"] = {}
# (run name, module, its own init args, strategy): EAGLE-3 with both strategies, then the block drafters
FITS = [("ddp", "Eagle3Module", {"ttt_steps": 2, "aux_layer_ids": [1, 2, 3]}, "ddp"),
        ("fsdp", "Eagle3Module", {"ttt_steps": 2, "aux_layer_ids": [1, 2, 3]}, "fsdp"),
        ("dflash", "DFlashModule", {"target_layer_ids": [1, 2], "block_size": 8, "anchors_per_row": 8}, "ddp"),
        ("dflash-flex", "DFlashModule", {"target_layer_ids": [1, 2], "block_size": 8, "anchors_per_row": 8,
                                         "attention": "flex"}, "ddp"),
        ("dspark", "DSparkModule", {"target_layer_ids": [1, 2], "block_size": 7, "anchors_per_row": 8,
                                    "markov_rank": 16, "confidence_head": True}, "ddp")]
missing = [m for m in ("datasets", "jsonargparse") if not have[m]]  # train-head's own needs
for name, module, init_args, strategy in FITS:
    if missing:
        results["train"][name] = {"returncode": None, "head": False,
                                  "skipped": f"train-head needs {', '.join(missing)}: install the project's dependencies"}
        say(f"train-head fit, {module}: not run, {results['train'][name]['skipped']}")
        continue
    if module == "Eagle3Module" and "eagle3" in skip:
        results["train"][name] = {"skipped": "--skip eagle3"}
        continue
    if args.cpu and (strategy == "fsdp" or init_args.get("attention") == "flex"):
        results["train"][name] = {"skipped": "Lightning's FSDP refuses accelerator=cpu" if strategy == "fsdp"
                                  else "FlexAttention has no backward on CPU"}
        continue
    cfg_file = work / f"{name}.yaml"
    cfg_file.write_text(yaml.safe_dump({
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu" if args.cpu else "gpu", "devices": 1, "strategy": strategy,
                    "max_steps": 20, "logger": False, "enable_progress_bar": False,
                    "precision": "32-true" if args.cpu else "bf16-mixed", "default_root_dir": str(work / name),
                    "gradient_clip_val": 1.0},
        "model": {"class_path": f"draftheads.training.{module}",
                  "init_args": {"target": str(target_dir), "target_dtype": "float32" if args.cpu else "bfloat16",
                                "lr": 1e-3, **init_args, "head_dir": str(work / name / "head")}},
        "data": {"train_files": [str(work / "data.jsonl")], "max_length": 64, "batch_size": 4, "val_fraction": 0.1},
    }))
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "draftheads.training.cli", "fit", "--config", str(cfg_file)],
                       env=env, capture_output=True, text=True)
    head_written = (work / name / "head" / "model.safetensors").is_file()
    results["train"][name] = {"module": module, "strategy": strategy, "returncode": r.returncode,
                              "seconds": time.time() - t0, "head": head_written,
                              "tail": (r.stderr or r.stdout).strip().splitlines()[-2:],
                              "errors": [ln for ln in (r.stderr or "").splitlines() if "Error" in ln or "error:" in ln][-6:]}
    say(f"train-head fit, {module} {strategy}, 20 steps: exit {r.returncode}, head written {head_written}, "
        f"{time.time() - t0:.0f} s")
(out / "results.json").write_text(json.dumps(results, indent=2, default=str))

# 7. greedy identity on the device: an oracle and every learned proposer (random heads) against the target's
# own greedy decoding, in float32 with TF32 off, on a small random target (the paths the kernels and tree attention take)
from draftheads.evaluation import classify_divergence  # noqa: E402
from draftheads.inference.proposers.dflash import DFlashProposer  # noqa: E402
from draftheads.inference.proposers.dspark import DSparkProposer  # noqa: E402
from draftheads.inference.proposers.eagle3 import Eagle3Proposer  # noqa: E402
from draftheads.inference.tree import TreeSpec  # noqa: E402
from draftheads.targets import load_target  # noqa: E402
from draftheads.testing import OracleProposer, random_heads  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
small = load_target(str(save_tiny_llama(work / "small", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2)),
                    device=device).model
heads = {k: h.to(device) for k, h in random_heads(small).items()}
tree = TreeSpec(depth=4, top_k=3, total_tokens=12)
# random heads are rarely accepted; the oracle (the target's own greedy drafts, wrong siblings beside) is
# accepted in full, so the tree's accept and KV-commit paths run on every step
PROPOSERS = {"oracle (tree)": (lambda: OracleProposer(small, 4, siblings=2, vocab=small.config.vocab_size), tree),
             "eagle3 (tree)": (lambda: Eagle3Proposer(heads["eagle3"], small), tree),
             "dflash (chain4)": (lambda: DFlashProposer(heads["dflash"], small), "chain4"),
             "dflash (tree)": (lambda: DFlashProposer(heads["dflash"], small), tree),
             "dspark (chain4)": (lambda: DSparkProposer(heads["dspark"], small, min_survival=0.0), "chain4"),
             "dspark (tree, cut)": (lambda: DSparkProposer(heads["dspark"], small, min_survival=0.3), tree)}
gen = torch.Generator().manual_seed(0)
rows = [torch.randint(small.config.vocab_size, (n,), generator=gen).tolist() for n in (40, 7, 23, 64)]
new_ids = 24


def greedy(ids):
    out = small.generate(torch.tensor([ids], device=device), max_new_tokens=new_ids, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


want = [] if "greedy" in skip else [greedy(r) for r in rows]
results["greedy"] = {}
for name, (make, shape) in ({} if "greedy" in skip else PROPOSERS).items():
    outs = Engine(small, proposer=make(), tree=shape).generate(rows, SamplingParams(max_new_tokens=new_ids,
                                                                                    stop_at_eos=False))
    diverged = [{"row": i, **classify_divergence(small, r, w, o.token_ids)}
                for i, (r, o, w) in enumerate(zip(rows, outs, want)) if o.token_ids != w]
    results["greedy"][name] = {"rows": len(rows), "identical": len(rows) - len(diverged), "diverged": diverged,
                               "tau": sum(o.metrics.tau for o in outs) / len(outs)}
    say(f"greedy identity {name}: {len(rows) - len(diverged)}/{len(rows)} rows identical"
        + (f", first differences at logit margins {[round(d['margin'], 6) for d in diverged]}" if diverged else ""))

# 8. DFlash's blocks masked by a compiled FlexAttention block mask against the dense SDPA mask, on the same
# batch: loss and head gradients in float32, then a bf16-autocast training step's time and peak memory
results["flex"] = ({"loss_rel": 0.0, "grad_rel": 0.0, "skipped": True} if "flex" in skip
                   else flex_vs_sdpa(target_dir, device, small=args.cpu))
fx = results["flex"]
say("flex vs sdpa: skipped" if "skipped" in fx else f"flex vs sdpa, DFlash training step {fx['shape']}: loss rel {fx['loss_rel']:.1e}, grads rel {fx['grad_rel']:.1e}"
    f"; tiles vs sdpa: loss rel {fx['tiles']['loss_rel']:.1e}, grads rel {fx['tiles']['grad_rel']:.1e}"
    + "".join(f"; {n} {fx[n]['step_ms']:.1f} ms {fx[n]['peak_gib']:.2f} GiB" for n in ("sdpa", "tiles", "flex")
              if "step_ms" in fx.get(n, {})))

(out / "results.json").write_text(json.dumps(results, indent=2, default=str))
say(f"| sampling T=0.7 | same seed same output: {results['sampling']['same_seed_same_output']}, "
    f"tau {results['sampling']['tau']:.2f} |")
for name, r in results["losses"].items():
    if isinstance(r, dict):
        say(f"| loss {name} liger vs chunked | value rel {r['loss_rel']:.1e}, grad rel "
            f"{max(r['grad_h_rel'], r['grad_w_rel']):.1e} |")
for name, r in results["train"].items():
    say(f"| train-head {name} 20 steps | " + (r["skipped"] if "skipped" in r else
                                              f"exit {r['returncode']}, head {r['head']}, {r['seconds']:.0f} s") + " |")
say("| DFlash flex vs sdpa | skipped |" if "skipped" in fx else f"| DFlash flex vs sdpa | loss rel {fx['loss_rel']:.1e}, grads rel {fx['grad_rel']:.1e}"
    + (f", step {fx['sdpa']['step_ms']:.0f} vs {fx['flex']['step_ms']:.0f} ms, peak {fx['sdpa']['peak_gib']:.1f} vs "
       f"{fx['flex']['peak_gib']:.1f} GiB" if "flex" in fx else "") + " |")
for name, r in results["greedy"].items():
    say(f"| greedy identity {name} | {r['identical']}/{r['rows']} rows, tau {r['tau']:.2f} |")
flex_off = max(fx["loss_rel"], fx["grad_rel"]) > 1e-3
loss_off = any(max(r["loss_rel"], r["grad_h_rel"], r["grad_w_rel"]) > 1e-2 for r in results["losses"].values()
               if isinstance(r, dict))
failed = (results["kernel_tests"]["returncode"] != 0 or flex_off or not results["sampling"]["same_seed_same_output"] or loss_off
          or any(r.get("returncode", 0) != 0 or r.get("head") is False for r in results["train"].values())
          # a difference counts unless the target itself tied the two tokens there (float32 sums in another order)
          or any(not d["near_tie"] for r in results["greedy"].values() for d in r["diverged"]))
sys.exit(1 if failed else 0)
