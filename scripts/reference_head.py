"""`make reference-head`: the shipped EAGLE-3 head for the embedded SmolLM2-135M-Instruct, in one command.

    synthesize -> distill --features -> train-head fit -> extend -> export -> eval -> package -> bench
    -> blocks -> scaling

Everything goes under runs/reference/ and the log to runs/reference/log.txt. Each stage runs the project's
own command (printed and logged); a rerun skips finished stages and resumes the unfinished one (synthesize
and distill after their last committed round or shard, training from its last checkpoint). A larger
--synth-prompts than the finished data holds extends synthesize and distill (only the new prompts are
written and answered) and redoes training and everything after it. `extend` trains the head on in rounds
(--extend-epochs, e.g. 2,4: 2 epochs more, then 4 more), each from the previous round's head with a fresh
warmup and schedule (a warm restart); adding a round keeps the finished ones. Each point of
the scaling curve trains on a fraction of the data for as many steps as the first fit, so the curve
compares data at equal compute. The machine's
plain batch-1 decode rate is measured first and written beside every stage time (machines differ ~3x).

--data-store DIR keeps the text the target writes (the synthesized prompts and the distilled answers, a few
MB) in DIR as it grows, finished or not, and a run whose directory lacks them starts from there: a machine
that loses its disk between sessions resumes the hours of generation from a committed or mounted DIR. With
a store, distill writes text only and the `features` stage runs the target over it once
(`draftheads cache-features`); without one, distill captures the features in its own generation pass.

`package` writes the head in bf16 with its CARD.md to draftheads/data/heads/smollm2-135m-eagle3/, only
when its chain-3 tau on the bundled eval beats the committed head's (or with --force); `bench` then adds its
side-by-side speedups to that card. The block drafters and the scaling curve, which the head does not depend
on, come after them (`scaling/scaling.md` holds the curve). --init-head reference trains the first fit on from
the shipped head (a warm restart, as each extension round is), so training carries over from one machine to
the next through the head that measured best; the card lists every run the head's weights went through.

    python scripts/reference_head.py [--synth-prompts 4300] [--redo STAGE,...|all] [--only STAGE,...]
                                     [--extend-epochs 2[,4...]]
                                     [--scaling 0.125,0.25,0.5] [--data-store DIR] [--init-head reference]
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from draftheads.utils import (
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    read_jsonl_prefix,
    shown_from,
)

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
STAGES = ("synthesize", "distill", "features", "train", "extend", "export", "eval", "package", "bench", "blocks",
          "scaling")
HEAD = "head"
"""In :data:`NEEDS`: the stage that makes the head the run exports (``extend``, or ``train`` with no rounds)."""
NEEDS = {"distill": ("synthesize",), "features": ("distill",), "train": ("features",), "extend": ("train",),
         "export": (HEAD,), "eval": (HEAD,), "package": (HEAD, "eval"), "bench": (HEAD,),
         "blocks": ("features", HEAD), "scaling": ("features", "train")}
"""The stages whose outputs each stage reads: with --only, they must be finished."""
BLOCK_FAMILIES = ("dflash", "dspark")
"""Block drafters the ``blocks`` stage trains on the same feature cache and benches beside EAGLE-3."""
BLOCK_MODES = ("chain3", "chain7", "small")
"""Modes the ``blocks`` stage evaluates and benches each head in: vLLM's chain of 3, the block drafters'
served K (block 8: 7 drafts), and the small tree."""
SHIPPED = ROOT / "draftheads/data/heads/smollm2-135m-eagle3"


def shown(path: Path) -> Path:
    """``path`` relative to the checkout when it lies inside it (a --run outside the checkout stays absolute)."""
    return shown_from(path, ROOT)


class Run:
    tick_seconds = 30.0
    """How often a running stage's wall time so far is saved (a killed run loses at most this much of it)."""

    def __init__(self, root: Path, only: frozenset[str] = frozenset()):
        self.root = root
        self.only = only  # the stages to run; empty: all
        root.mkdir(parents=True, exist_ok=True)
        self.log = (root / "log.txt").open("a", encoding="utf-8")
        self.times_file = root / "stages.json"
        self.times = json.loads(self.times_file.read_text()) if self.times_file.is_file() else {}
        self._stage, self._prior, self._t0 = None, 0.0, 0.0
        self._lock = threading.Lock()  # the ticker thread and the main thread both save the times
        self.on_tick: list = []
        """Called (with no argument) after every tick and after every stage, outside the lock."""

    def say(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def save_times(self) -> None:
        with self._lock:
            atomic_write_json(self.times_file, self.times)

    def _tick(self) -> None:
        """Record the running stage's wall time so far, with the time of earlier, interrupted runs of it."""
        with self._lock:
            if self._stage is None:
                return
            self.times.setdefault("running", {})[self._stage] = round(self._prior + time.perf_counter() - self._t0, 1)
            atomic_write_json(self.times_file, self.times)
        self._hooks()

    def _hooks(self) -> None:
        for fn in self.on_tick:
            fn()

    def _ticking(self, stop: threading.Event) -> None:
        """Tick every ``tick_seconds`` until ``stop``: a clock, not the stage's output, whose lines can be
        far apart (a training epoch's progress bar redraws one line with carriage returns)."""
        while not stop.wait(self.tick_seconds):
            self._tick()

    def cmd(self, stage: str, argv: list[str]) -> None:
        self.say(f"=== {stage}: {' '.join(argv)}")
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            if "it/s]" in line or "s/it]" in line:
                continue  # progress bars
            sys.stdout.write(line)
            self.log.write(line)
            self.log.flush()
        if proc.wait() != 0:
            self.say(f"stage {stage} failed (exit {proc.returncode}); fix the error above and rerun: finished "
                     "stages are kept and this one resumes")
            sys.exit(1)

    def forget(self, name: str) -> None:
        """Drop the recorded time of a stage that is made again."""
        self.times.pop(name, None)
        self.times.get("running", {}).pop(name, None)
        self.times.get("machines", {}).pop(name, None)
        self.save_times()

    def stage(self, name: str, done: Path, fn, finished: bool = True, grown: bool = False) -> None:
        """Run ``fn`` unless ``done`` exists (and ``finished``: the output is not one to be grown); ``grown``:
        part of the stage's output was made before (its recorded time counts)."""
        if done.exists() and finished:
            self.say(f"=== {name}: reusing {shown(done)} (--redo {name} to run it again)")
            return
        if self.only and name not in self.only:
            self.say(f"=== {name}: not run (not in --only)")
            return
        # an interrupted run's time counts, and so does the first making of an output that is now grown
        grown = grown or done.exists()
        self._stage = name
        self._prior = self.times.get("running", {}).get(name) or (self.times.get(name, 0.0) if grown else 0.0)
        self._t0 = time.perf_counter()
        rate = self.times.get("plain_tok_s")
        machines = self.times.setdefault("machines", {}).setdefault(name, [])
        if rate and rate not in machines:
            machines.append(rate)  # the plain decode rate of each machine the stage ran on
        if self._prior:
            how = "growing its output" if grown else "resuming"
            self.say(f"=== {name}: {how}; {self._prior:.0f} s of earlier runs count towards it")
        stop = threading.Event()
        ticker = threading.Thread(target=self._ticking, args=(stop,), daemon=True)
        ticker.start()
        try:
            fn()
        finally:
            stop.set()
            ticker.join()
        with self._lock:
            self.times[name] = round(self._prior + time.perf_counter() - self._t0, 1)
            self.times.get("running", {}).pop(name, None)
            self._stage = None
        self.save_times()
        self._hooks()
        self.say(f"=== {name}: done in {self.times[name]:.0f} s (wall time over every run of the stage)")


STORED = {"synthesize": ("synth.jsonl", ".stats.json"), "distill": ("train.jsonl", ".settings.json")}
"""What a data store keeps per stage: the output under the run's data/ and what a finished one has beside it
(a stage still running has ``.partial`` and ``.partial.json`` instead, which resume it)."""


def distill_prompts(data: Path) -> list[str]:
    """What distill answers: the bundled train prompts and the synthesized ones under the run's ``data``."""
    return ["bundled:train", str(data / "synth.jsonl")]


SLIM = ("train.jsonl", "train.jsonl.partial")
"""Distilled records the store keeps without their turns, which the prompts they answer hold."""
PART_BYTES = 4 << 20
"""The store keeps a file over this size in parts of at most this size (``NAME.part1``, ``NAME.part2``, ...),
cut at line ends, so that no file it commits to git is a large one."""


def store_parts(dst: Path) -> list[Path]:
    """The parts ``dst`` is kept in: itself, or ``dst.part1``, ``dst.part2``, ... (in order)."""
    parts = []
    while (part := dst.with_name(f"{dst.name}.part{len(parts) + 1}")).is_file():
        parts.append(part)
    return parts or [dst]


def write_parts(dst: Path, data: bytes) -> None:
    """``data`` at ``dst``, or over ``PART_BYTES`` in parts cut at line ends. The stored files only grow, so a
    rewrite changes the last part and adds new ones; the parts and the whole file of the other form go."""
    chunks, start = [], 0
    while start < len(data):
        end = len(data) if len(data) - start <= PART_BYTES else data.rfind(b"\n", start, start + PART_BYTES) + 1
        end = end if end > start else (data.find(b"\n", start) + 1 or len(data))  # a longer line stays whole
        chunks.append(data[start:end])
        start = end
    old = store_parts(dst)
    names = [dst] if len(chunks) <= 1 else [dst.with_name(f"{dst.name}.part{i}") for i in range(1, len(chunks) + 1)]
    for name, chunk in zip(names, chunks or [b""]):
        atomic_write_bytes(name, chunk)
    for stale in set(old) - set(names):
        stale.unlink(missing_ok=True)


def read_parts(src: Path) -> bytes:
    """What :func:`write_parts` wrote at ``src``."""
    return b"".join(p.read_bytes() for p in store_parts(src))


def remove_parts(dst: Path) -> None:
    """What :func:`write_parts` wrote at ``dst`` removed (nothing if it is not there)."""
    for part in store_parts(dst):
        part.unlink(missing_ok=True)


def without_turns(records: list[dict]) -> bytes:
    """Distilled records as jsonl, each without its turns."""
    return "".join(json.dumps({k: v for k, v in r.items() if k != "turns"}) + "\n" for r in records).encode()


def with_turns(records: list[dict], prompts: dict) -> bytes:
    """Records stored :func:`without_turns` as jsonl, with the turns each one answered put back from ``prompts``."""
    return "".join(json.dumps({"id": r["id"], "domain": r["domain"],
                               "turns": list(prompts[r["id"]].turns[: len(r["answers"])]),
                               **{k: v for k, v in r.items() if k not in ("id", "domain")}}) + "\n"
                   for r in records).encode()


class DataStore:
    """The text outputs of synthesize and distill kept in a directory that outlives the run's (see --data-store).

    :meth:`save` copies each one there as it grows (finished files replace the partial ones, and the partial
    ones of a growing output replace the finished ones they extend); :meth:`seed` puts
    the stored ones into a run directory that lacks them, with the wall time and machines they took."""

    def __init__(self, root: Path, data: Path):
        self.root, self.data = root, data
        self._copied: dict[Path, tuple] = {}
        self._lock = threading.Lock()  # the ticker thread and the main thread both save

    @staticmethod
    def files(stage: str, finished: bool) -> list[str]:
        """A stage's files, the settings first: a copy cut between the two never holds text its settings lack."""
        name, beside = STORED[stage]
        return [name + beside, name] if finished else [name + ".partial.json", name + ".partial"]

    def holds(self, where: Path, stage: str) -> bool | None:
        """True: finished, False: partly made, None: nothing of ``stage`` under ``where`` (the run's data or
        the store, whose files may be in parts)."""
        for finished in (True, False):
            if all(store_parts(where / f)[0].is_file() for f in self.files(stage, finished)):
                return finished
        return None

    def _copy(self, src: Path, dst: Path) -> None:
        st = src.stat()
        if self._copied.get(dst) == (st.st_size, st.st_mtime_ns) and dst.is_file():
            return
        # a growing file's torn last line is left out
        write_parts(dst, without_turns(read_jsonl_prefix(src)) if dst.name in SLIM else src.read_bytes())
        self._copied[dst] = (st.st_size, st.st_mtime_ns)

    def save(self, times: dict) -> None:
        with self._lock:
            self.root.mkdir(parents=True, exist_ok=True)
            kept = {}
            for stage in STORED:
                finished = self.holds(self.data, stage)
                if finished is None:
                    continue
                try:
                    for f in self.files(stage, finished):
                        self._copy(self.data / f, self.root / f)
                except FileNotFoundError:
                    continue  # the stage is renaming its partial files to finished ones: the next save has them
                # the other kind goes: a finished file replaces the partial one it was, and a partial one is an
                # extension (--extend reopens the finished file as the partial one), holding all of it
                for f in self.files(stage, not finished):
                    remove_parts(self.root / f)
                kept[stage] = {"finished": finished, "machines": times.get("machines", {}).get(stage, []),
                               "seconds": times.get(stage) if finished else times.get("running", {}).get(stage)}
            if kept:
                atomic_write_json(self.root / "stages.json", kept)

    def seed(self, run: Run) -> None:
        """Copy into the run each stage the store holds and the run lacks, and its time so far."""
        times = json.loads((self.root / "stages.json").read_text()) if (self.root / "stages.json").is_file() else {}
        for stage in STORED:
            finished = self.holds(self.root, stage)
            if finished is None or self.holds(self.data, stage) is not None:
                continue
            self.data.mkdir(parents=True, exist_ok=True)
            for f in self.files(stage, finished):
                stored = read_parts(self.root / f)
                if f in SLIM:  # whole lines only: the store never keeps a torn one
                    stored = with_turns([json.loads(line) for line in stored.splitlines() if line.strip()],
                                        self._prompts())
                atomic_write_bytes(self.data / f, stored)
            t = times.get(stage, {})
            if t.get("seconds") is not None:
                (run.times if finished else run.times.setdefault("running", {}))[stage] = t["seconds"]
                run.times.setdefault("machines", {})[stage] = list(t.get("machines", []))
            run.save_times()
            run.say(f"=== {stage}: {'finished' if finished else 'partly made'} output taken from the data store "
                    f"{shown(self.root)}")

    def seeds(self, stage: str) -> Path | None:
        """The store's finished output of ``stage`` that :meth:`seed` puts into a run holding nothing of it."""
        if self.holds(self.root, stage) and self.holds(self.data, stage) is None:
            return self.root / STORED[stage][0]
        return None

    def _prompts(self) -> dict:
        from draftheads.prompts import load_prompts

        return {p.id: p for spec in distill_prompts(self.data) for p in load_prompts(spec)}

    def drop(self, stage: str) -> None:
        """Forget a stage that is made again (so that no later run is seeded with the old output)."""
        for f in self.files(stage, True) + self.files(stage, False):
            remove_parts(self.root / f)


def plain_decode_rate(tokens: int = 64) -> float:
    """Batch-1 greedy tokens/s of the default target in the engine (fp32), the machine's yardstick."""
    from draftheads.inference.engine import Engine
    from draftheads.inference.sampling import SamplingParams
    from draftheads.prompts import encode_chat
    from draftheads.targets import load_target

    t = load_target("smollm2-135m")
    ids = encode_chat(t.tokenizer, [{"role": "user", "content": "Explain how a bicycle works."}])
    engine = Engine(t.model, t.tokenizer)
    engine.generate([ids[:8]], SamplingParams(max_new_tokens=2))
    (out,) = engine.generate([ids], SamplingParams(max_new_tokens=tokens, stop_at_eos=False))
    return out.metrics.tokens_per_s


def native_dtype() -> str:
    """bfloat16 where the hardware computes it natively (a CUDA device with bf16, or a CPU oneDNN runs bf16
    kernels on), else float32: emulated bf16 is slower than float32."""
    import torch

    if torch.cuda.is_available():
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    native = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)()
    return "bfloat16" if native else "float32"


def train_config(run: Path, name: str, args, fraction: float = 1.0,
                 base: str = "configs/smollm2-eagle3-reference.yaml", epochs: int | None = None,
                 init_head: Path | None = None, trainer: dict | None = None, model: dict | None = None) -> Path:
    """``base`` (a reference config) with its paths under ``run/name``, ``epochs`` (default ``--epochs``),
    ``--precision``, ``trainer`` and ``model`` overrides and, given ``init_head``, training on from that head (peak learning rate
    ``--restart-lr`` where given)."""
    from draftheads.training.cli import config_under, save_config

    epochs = epochs or args.epochs
    trainer = {"precision": args.precision, **({"max_epochs": epochs} if epochs else {}), **(trainer or {})}
    model = dict(model or {})
    if init_head:
        model |= {"init_head": str(init_head), **({"lr": args.restart_lr} if args.restart_lr else {})}
    cfg = config_under(ROOT / base, run / name, run / "features", trainer=trainer, model=model,
                       data={"train_fraction": fraction} if fraction < 1 else None)
    return save_config(cfg, run / name / "train.yaml", f"{base} by scripts/reference_head.py")


def eagle3_shape(args) -> dict:
    """Overrides of the EAGLE-3 head's shape (``--intermediate-size``) for its fits' configs."""
    return {"intermediate_size": args.intermediate_size} if args.intermediate_size else {}


def fit(run: Run, stage: str, config: Path) -> None:
    cmd = [str(BIN / "train-head"), "fit", "--config", str(config)]
    if (config.parent / "train/checkpoints/last.ckpt").exists():
        cmd += ["--ckpt_path", "last"]
    run.cmd(stage, cmd)


def synthesized(synth: Path) -> int:
    """Prompts a finished synthesize output holds."""
    return json.loads(synth.with_name(synth.name + ".stats.json").read_text())["total"]


def grows(synth: Path, store: DataStore | None, wanted: int) -> bool:
    """Whether the finished prompts this run starts from, its own or those the store seeds it with, are
    fewer than ``wanted`` (synthesize and distill then extend them, and training starts over)."""
    held = synth if synth.exists() else store.seeds("synthesize") if store else None
    return held is not None and synthesized(held) < wanted


def distilled_all(data: Path, synth: Path) -> bool:
    """Whether the distilled records answer every bundled train prompt and every synthesized one."""
    from draftheads.prompts import load_prompts

    with data.open() as f:
        answered = sum(1 for line in f if line.strip())
    return answered == len(load_prompts("bundled:train")) + synthesized(synth)


def feature_tokens(features: Path) -> dict:
    """Per split of a feature cache: conversations, answer (loss-masked) tokens and all tokens."""
    from draftheads.training.features import FeatureDataset

    out = {}
    for split in ("train", "val"):
        ds = FeatureDataset(features, split)
        out[split] = {"answer_tokens": sum(int(m.sum()) for m in ds.column("loss_mask")),
                      "tokens": sum(int((d >= 0).sum()) for d in ds.column("doc_ids")),
                      # doc ids count 0.. within each row (-1 pads): a row holds its largest id + 1
                      "conversations": sum(int((d.amax(dim=-1) + 1).clamp(min=0).sum()) for d in ds.column("doc_ids"))}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", default="runs/reference",
                   help="run directory (one outside the checkout survives a fresh clone of it)")
    p.add_argument("--redo", default="", help="comma list of stages to run again, or all")
    p.add_argument("--only", default="",
                   help="comma list of the stages to run, the others left as they are; the stages they read must be "
                        "finished (e.g. scaling while an extend round is unfinished)")
    p.add_argument("--synth-prompts", type=int, default=4300,
                   help="prompts the target writes (plus the bundled 228); raising it extends finished data")
    p.add_argument("--max-new-tokens", type=int, default=384, help="answer length when distilling")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--dtype", default="auto",
                   help="synthesize, distill and bench dtype (eval stays float32, where greedy output must equal "
                        "plain decoding's token for token); auto: bfloat16 where the CPU or GPU computes it natively "
                        "(2-3x faster than float32 on a CPU with AVX512-BF16), else float32")
    p.add_argument("--epochs", type=int, default=None, help="override the config's max_epochs")
    p.add_argument("--extend-epochs", default="2",
                   help="rounds of epochs more (e.g. 2,4), each from the previous round's head with a fresh warmup and "
                        "schedule; the last round's head is the one exported, evaluated and packaged, while the scaling "
                        "curve compares data at the first fit's steps (0 = none)")
    p.add_argument("--precision", default="auto",
                   help="training precision (Lightning's); auto: bf16-mixed where bf16 is native (1.6-2x faster "
                        "EAGLE-3 steps than 32 on a CPU with AVX512-BF16), else 32")
    p.add_argument("--eval-per-domain", type=int, default=12)
    p.add_argument("--eval-tokens", type=int, default=128)
    p.add_argument("--trees", default="chain3,small,medium", help="eval modes")
    p.add_argument("--scaling", default="0.125,0.25,0.5", help="training fractions for the scaling curve ('' = skip)")
    p.add_argument("--scaling-eval-per-domain", type=int, default=3)
    p.add_argument("--force", action="store_true", help="package even if the committed head measures better")
    p.add_argument("--package-dir", default=str(SHIPPED.relative_to(ROOT)),
                   help="where the packaged head goes (default: the shipped head in the package)")
    p.add_argument("--init-head", default=None,
                   help="start the first fit from this head (a directory, or reference: the shipped head) instead "
                        "of a new one: a warm restart with a fresh schedule")
    p.add_argument("--restart-lr", type=float, default=None,
                   help="peak learning rate of every fit that starts from a trained head (--init-head, extension "
                        "rounds); default: the config's. A lower one keeps more of what the head has learnt")
    p.add_argument("--intermediate-size", type=int, default=None,
                   help="MLP width of the EAGLE-3 draft layer (default: the target's); with --init-head, a larger "
                        "one widens that head, its new units starting with no effect on its output")
    p.add_argument("--from-answer", type=int, default=0,
                   help="cache features for, and train and validate on, the distilled answers from this one on (0-based, "
                        "in the order distill wrote them): e.g. with --init-head, only those its head has not seen "
                        "(the shipped head: the first 4528)")
    p.add_argument("--data-store", default=None,
                   help="keep the synthesized prompts and distilled answers here as they grow, and start a run "
                        "that lacks them from here (a directory that outlives the run's: committed or mounted)")
    args = p.parse_args()
    redo = set(STAGES) if args.redo == "all" else {s for s in args.redo.split(",") if s}
    if redo - set(STAGES):
        sys.exit(f"reference-head: --redo {sorted(redo - set(STAGES))} unknown: use all or some of {','.join(STAGES)}")
    only = frozenset(s for s in args.only.split(",") if s)
    if only - set(STAGES):
        sys.exit(f"reference-head: --only {sorted(only - set(STAGES))} unknown: use some of {','.join(STAGES)}")
    if args.dtype == "auto":
        args.dtype = native_dtype()
    if args.precision == "auto":
        args.precision = "bf16-mixed" if native_dtype() == "bfloat16" else "32"
    root = ROOT / Path(args.run).expanduser()
    run = Run(root, only)
    dh = str(BIN / "draftheads")
    synth, data, features = root / "data/synth.jsonl", root / "data/train.jsonl", root / "features"
    rounds = extend_rounds(args.extend_epochs)
    trained, extended = root / "main/head", [root / round_dir(i) / "head" for i in range(len(rounds))]
    export, evald, bench = root / "export", root / "eval", root / "bench"
    head = extended[-1] if rounds else trained
    rounds_made = made_rounds(root)  # every round there, of these rounds or of earlier ones
    stale = next((i for i, d in enumerate(rounds_made) if i < len(rounds) and trained_epochs(d) != rounds[i]), None)
    if stale is not None:  # a round trained for other epochs: it and the rounds after it are made again
        d = rounds_made[stale]
        run.say(f"extend: round {stale + 1} ({d.name}) was trained for {trained_epochs(d)} epochs, not "
                f"{rounds[stale]}: it and the rounds after it are made again")
        for d in rounds_made[stale:]:
            shutil.rmtree(d)
        rounds_made = rounds_made[:stale]
    scaling = root / "scaling"
    answers = sliced_answers(data, args.from_answer)
    if features.exists() and (cached_from := features_from(root)) != args.from_answer:
        run.say(f"features: cached from answer {cached_from} on, not --from-answer {args.from_answer}: made again")
        redo.add("features")
    outputs = {"synthesize": synth, "distill": data, "features": features, "train": trained, "extend": head,
               "export": export, "eval": evald / "results.json",
               "bench": bench / "results.json", "scaling": scaling / "scaling.json", "package": root / "packaged.json",
               "blocks": root / "blocks/results.json"}
    store = DataStore(ROOT / Path(args.data_store).expanduser(), root / "data") if args.data_store else None
    grow = "synthesize" not in redo and grows(synth, store, args.synth_prompts)
    if grow:
        # the data grows in place: the head and everything after it are made again, and with a store the
        # features too (its distill writes text only; without one, distill adds the new rows' features itself)
        redo.add("features" if store else "train")
    for s in STAGES[min((STAGES.index(s) for s in redo), default=len(STAGES)):]:
        redo.add(s)  # a redone stage invalidates the ones after it
    if rounds and not head.exists():
        redo |= {"export", "eval", "bench", "package"}  # they were made from the head before its last round
    blocks = [root / f for f in BLOCK_FAMILIES] + [root / "blocks"]
    also_made = {"distill": [features, root / "main", *rounds_made, *blocks],
                 "features": [root / "main", *rounds_made, *blocks], "train": [root / "main", *rounds_made],
                 "extend": rounds_made, "eval": [evald], "bench": [bench], "blocks": blocks,
                 "scaling": [scaling, root / "main/eval-chain3"]}  # what else a stage wrote (checkpoints, logs, tables)
    head_stage = "extend" if rounds else "train"
    if need := unmet_need(only, head_stage, lambda n: n not in redo):  # refused before anything is removed
        sys.exit(f"reference-head: --only {need[0]} reads what {need[1]} makes, and --redo makes {need[1]} again: "
                 f"add {need[1]} to --only, or leave it out of --redo")
    for s in redo:
        run.forget(s)
        for target in [outputs[s], *also_made.get(s, [])]:
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    if store:
        for s in redo & set(STORED):
            store.drop(s)  # a store seeding a later run with what this one makes again would undo the redo
    run.say(f"reference-head: {' '.join(sys.argv[1:]) or '(defaults)'}")
    if store:
        store.seed(run)
        run.on_tick.append(lambda: store.save(run.times))
    done = {**outputs, "features": features / "index.json"}
    finished = {s: done[s].exists() for s in STAGES}
    finished["distill"] = finished["distill"] and synth.exists() and distilled_all(data, synth)
    if need := unmet_need(only, head_stage, lambda n: finished[n]):
        sys.exit(f"reference-head: --only {need[0]} reads what {need[1]} makes, and it is not finished: add it to "
                 "--only, or run without --only")
    # measured at every start: a resumed run may be on another machine, and each stage lists the rates of the
    # machines it ran on
    run.times["plain_tok_s"] = round(plain_decode_rate(), 2)
    run.save_times()
    run.say(f"machine: plain decode {run.times['plain_tok_s']:.1f} tok/s at batch 1 (fp32, engine)")
    run.say(f"synthesize, distill and bench in {args.dtype}; train in precision {args.precision}; eval in float32")

    if grow:
        run.say(f"synthesize: {shown(synth)} holds {synthesized(synth)} prompts, fewer than "
                f"--synth-prompts {args.synth_prompts}: it and the distilled data are extended")
    run.stage("synthesize", synth, lambda: run.cmd("synthesize", [
        dh, "synthesize", "--num-prompts", str(args.synth_prompts), "--batch-size", str(args.batch_size),
        "--round-size", str(min(192, 2 * args.synth_prompts)),
        "--dtype", args.dtype, "--out", str(synth), "--extend"]), finished=not grow)
    # with a store, the answers are text a later run resumes from, and their features a pass of their own
    same_pass = [] if store else ["--features", "eagle3", "--feature-dir", str(features), "--val-fraction", "0.03"]
    run.stage("distill", data, lambda: run.cmd("distill", [
        dh, "distill", "--prompts", *distill_prompts(synth.parent), "--max-new-tokens", str(args.max_new_tokens),
        "--batch-size", str(args.batch_size), "--dtype", args.dtype, "--max-seq-len", "1024", *same_pass,
        "--out", str(data), "--extend"]), finished=data.exists() and distilled_all(data, synth))
    run.stage("features", features / "index.json", lambda: (_slice(data, answers, args.from_answer, root), run.cmd(
        "features", [dh, "cache-features", "--data", str(answers), "--layers", "eagle3", "--out", str(features), "--max-length",
        "1024", "--val-fraction", "0.03", "--dtype", args.dtype, "--overwrite"])))
    run.stage("train", trained, lambda: _train(run, root, args))
    if rounds:
        run.stage("extend", head, lambda: _extend(run, root, rounds, trained, args), grown=extended[0].exists())
    run.stage("export", export, lambda: run.cmd("export", [
        dh, "export", "--head", str(head), "--format", "vllm-eagle3", "--out", str(export), "--verifier",
        "smollm2-135m"]))
    run.stage("eval", evald / "results.json", lambda: run.cmd("eval", [
        dh, "eval", "--head", str(head), "--prompts", "bundled:eval", "--limit-per-domain", str(args.eval_per_domain),
        "--max-new-tokens", str(args.eval_tokens), "--tree", args.trees, "--out", str(evald)]))
    # every eval mode: the eval ranks them in float32, where a larger tree costs more than in bf16
    modes = ",".join(dict.fromkeys(["auto", *args.trees.split(",")]))
    run.stage("package", outputs["package"], lambda: _package(run, root, head, features, evald, args))
    run.stage("bench", bench / "results.json", lambda: (run.cmd("bench", [
        dh, "bench", "--eagle3", str(head), "--tree", modes, "--only", "proposers,batch", "--max-new-tokens",
        str(args.eval_tokens), "--batches", "1,4,16", "--batch-repeats", "8", "--dtype", args.dtype,
        "--out", str(bench)]), _card_bench(run, root, bench, args)))
    run.stage("blocks", outputs["blocks"], lambda: _blocks(run, root, head, args))
    fractions = [float(f) for f in args.scaling.split(",") if f.strip()]
    run.stage("scaling", outputs["scaling"], lambda: _scaling(run, root, fractions, features, args))
    if outputs["scaling"].exists():
        _card_scaling(run, root, features, args)
    run.say(f"reference-head: {'stages ' + ','.join(sorted(only, key=STAGES.index)) if only else 'all stages'} done; "
            "stage times " + json.dumps(run.times))
    return 0


def sliced_answers(data: Path, start: int) -> Path:
    """The answers the features stage reads: all of ``data``, or (``start`` > 0) a file of those from ``start`` on."""
    return data if start == 0 else data.with_name(f"{data.stem}.from{start}.jsonl")


def features_from(root: Path) -> int:
    """The --from-answer the run's feature cache was made with (0 where it has no record of one)."""
    f = root / "features-from.json"
    return json.loads(f.read_text())["from_answer"] if f.is_file() else 0


def _slice(data: Path, answers: Path, start: int, root: Path) -> None:
    """Write ``answers`` (the lines of ``data`` from ``start`` on) and record ``start`` for the feature cache."""
    if answers != data:
        lines = data.read_bytes().splitlines(keepends=True)
        if start >= len(lines):
            sys.exit(f"reference-head: --from-answer {start}: {shown(data)} holds {len(lines)} answers; give a "
                     "smaller one")
        atomic_write_bytes(answers, b"".join(lines[start:]))
    atomic_write_json(root / "features-from.json", {"from_answer": start})


def unmet_need(only: frozenset, head_stage: str, finished) -> tuple[str, str] | None:
    """The first (stage of --only, stage it reads) where the stage read is neither in --only nor ``finished``."""
    for s in sorted(only, key=STAGES.index):
        for n in NEEDS.get(s, ()):
            n = head_stage if n == HEAD else n
            if n not in only and not finished(n):
                return s, n
    return None


def init_head_dir(spec: str) -> Path:
    """--init-head as a directory (``reference``: the shipped head)."""
    return SHIPPED if spec == "reference" else ROOT / Path(spec).expanduser()


def _train(run: Run, root: Path, args) -> None:
    """The first fit, from a new head or (--init-head) from a trained one, whose card is kept for the lineage."""
    init = None
    if args.init_head:
        init = init_head_dir(args.init_head)
        if not (init / "config.json").is_file():
            sys.exit(f"reference-head: --init-head {args.init_head}: no head in {shown(init)} (give a head "
                     "directory, or reference once a head is shipped)")
        card = init / "card.json"
        (root / "main").mkdir(parents=True, exist_ok=True)
        if card.is_file() and not (root / "main/init-card.json").exists():
            shutil.copy(card, root / "main/init-card.json")  # before package replaces it
    fit(run, "train", train_config(root, "main", args, init_head=init, model=eagle3_shape(args)))


def lineage(root: Path, args, answer_tokens: int | None = None) -> list[dict]:
    """Every run the packaged head's weights went through, the first first: the init head's lineage (from its
    card), then this run (its epochs: the first fit's and every extension round's; the training answer tokens)."""
    prev = root / "main/init-card.json"
    runs = []
    if prev.is_file():
        old = json.loads(prev.read_text())
        runs = old.get("lineage") or [{"date": old["date"], "command": old["command"], "epochs": None}]
        if len(runs) == 1 and "answer_tokens" not in runs[0] and "data" in old:  # a card from before the count
            runs = [{**runs[0], "answer_tokens": old["data"]["train"]["answer_tokens"]}]
    return runs + [{"date": time.strftime("%Y-%m-%d"), "command": this_command(), "epochs": run_epochs(args),
                    "answer_tokens": answer_tokens}]


def this_command() -> str:
    return shlex.join(["python", "scripts/reference_head.py", *sys.argv[1:]])  # quoted: --scaling '' stays whole


def extend_rounds(spec: str) -> list[int]:
    """``--extend-epochs`` as epochs per round: "2,4" -> [2, 4]; "0" or "" -> no round."""
    rounds = [int(x) for x in str(spec).split(",") if x.strip()]
    if any(r < 0 for r in rounds) or (0 in rounds and rounds != [0]):
        sys.exit(f"reference-head: --extend-epochs {spec}: give epochs per round, each >= 1 (e.g. 2,4), or 0 for none")
    return [] if rounds == [0] else rounds


def round_dir(i: int) -> str:
    """The run directory of extension round ``i`` (0-based): extended, extended2, extended3, ..."""
    return "extended" if i == 0 else f"extended{i + 1}"


def made_rounds(root: Path) -> list[Path]:
    """The extension rounds' directories under ``root``, in order (round 1, 2, ... while they follow on)."""
    out = []
    while (root / round_dir(len(out))).is_dir():
        out.append(root / round_dir(len(out)))
    return out


def trained_epochs(path: Path) -> int | None:
    """The epochs a run directory (a round, a scaling point) was trained for (its train.yaml), None if it has none."""
    import yaml

    cfg = path / "train.yaml"
    return yaml.safe_load(cfg.read_text())["trainer"].get("max_epochs") if cfg.is_file() else None


def _extend(run: Run, root: Path, rounds: list[int], trained: Path, args) -> None:
    """Each round trains on from the previous round's head (the first from the trained one)."""
    start = trained
    for i, epochs in enumerate(rounds):
        out = root / round_dir(i)
        if not (out / "head").exists():
            fit(run, "extend" if i == 0 else f"extend round {i + 1}",
                train_config(root, round_dir(i), args, epochs=epochs, init_head=start, model=eagle3_shape(args)))
        start = out / "head"


def _blocks(run: Run, root: Path, head: Path, args) -> None:
    """DFlash and DSpark trained on the same feature cache as the EAGLE-3 head (configs/smollm2-<family>-
    reference.yaml) for as many epochs as its run (:func:`run_epochs`), each evaluated like it at chain 3
    and chain 7 (the block drafters' served K) and with the small tree, then all three benched side by side
    in one run in those modes and ``auto`` (batch 1, and the sweep over 1, 4, 16)."""
    dh = str(BIN / "draftheads")
    heads = {"eagle3": head}
    for fam in BLOCK_FAMILIES:
        heads[fam] = root / fam / "head"
        if not heads[fam].exists():
            fit(run, f"blocks {fam}", train_config(root, fam, args, base=f"configs/smollm2-{fam}-reference.yaml",
                                                   epochs=run_epochs(args)))
    for fam, h in heads.items():
        ev = root / "blocks" / f"eval-{fam}"
        if not (ev / "results.json").exists():
            run.cmd(f"blocks eval {fam}", [
                dh, "eval", "--head", str(h), "--prompts", "bundled:eval", "--limit-per-domain",
                str(args.eval_per_domain), "--max-new-tokens", str(args.eval_tokens), "--tree", ",".join(BLOCK_MODES),
                "--out", str(ev)])
    run.cmd("blocks bench", [dh, "bench", *[a for fam, h in heads.items() for a in (f"--{fam}", str(h))],
                             "--tree", ",".join(["auto", *(m for m in BLOCK_MODES if m != "chain3")]),  # it adds chain3
                             "--only", "proposers,batch", "--max-new-tokens", str(args.eval_tokens),
                             "--batches", "1,4,16", "--batch-repeats", "8", "--dtype", args.dtype,
                             "--out", str(root / "blocks" / "bench")])
    table = {fam: json.loads((root / "blocks" / f"eval-{fam}" / "results.json").read_text())["modes"]
             for fam in heads}
    atomic_write_json(root / "blocks" / "results.json", {
        fam: {m: {"tau": v["overall"]["tau"], "speedup": v["overall"]["speedup"]} for m, v in modes.items()}
        for fam, modes in table.items()})


def run_epochs(args) -> int:
    """Epochs this run trains the EAGLE-3 head: the first fit's and every extension round's."""
    return base_epochs(args) + sum(extend_rounds(args.extend_epochs))


def base_epochs(args) -> int:
    """Epochs of the first fit: ``--epochs``, else the reference config's."""
    import yaml

    return args.epochs or yaml.safe_load((ROOT / "configs/smollm2-eagle3-reference.yaml").read_text())["trainer"]["max_epochs"]


def scaling_schedule(args, fraction: float) -> dict:
    """Trainer settings of a scaling point: as many optimizer steps as the first fit (1 / ``fraction`` times
    its epochs, so a smaller subset is seen more often), validated as often as the first fit in all."""
    epochs = base_epochs(args)
    times = max(1, round(1 / fraction))
    return {"max_epochs": epochs * times, "val_check_interval": 1.0 if times > 1 else 0.5,
            "check_val_every_n_epoch": max(1, times // 2)}


def _scaling(run: Run, root: Path, fractions: list[float], features: Path, args) -> None:
    """Validation accuracy per TTT step and chain-3 tau against training tokens, each point trained for
    the first fit's number of steps: the curve compares data at equal compute (the first fit's own
    validations, at a half, one and one and a half epochs, compare steps at equal data)."""
    dh = str(BIN / "draftheads")
    train_answer_tokens = feature_tokens(features)["train"]["answer_tokens"]
    points = []
    for f in sorted(fractions) + [1.0]:
        # the first fit is the full-data point, unless it started from a trained head (--init-head)
        name = "main" if f == 1.0 and not args.init_head else f"scaling/f{f:g}"
        h = root / name / "head"
        schedule = scaling_schedule(args, f) if f < 1.0 else {}
        if schedule and trained_epochs(root / name) not in (None, schedule["max_epochs"]):
            run.say(f"scaling {f:g}: {name} was trained on another schedule; training it again")
            shutil.rmtree(root / name)
        if not h.exists():
            fit(run, f"scaling {f:g}", train_config(root, name, args, f, trainer=schedule, model=eagle3_shape(args)))
        ev = root / name / "eval-chain3"
        if not (ev / "results.json").exists():
            run.cmd(f"scaling eval {f:g}", [
                dh, "eval", "--head", str(h), "--prompts", "bundled:eval", "--limit-per-domain",
                str(args.scaling_eval_per_domain), "--max-new-tokens", str(args.eval_tokens), "--tree", "chain3",
                "--out", str(ev)])
        meta = json.loads((h / "config.json").read_text())
        res = json.loads((ev / "results.json").read_text())["modes"]["chain3"]["overall"]
        points.append({"fraction": f, "answer_tokens": int(round(f * train_answer_tokens)),
                       "epochs": schedule.get("max_epochs", base_epochs(args)),
                       "val_acc": meta.get("val_accuracies"), "val_sim_tau": meta.get("val_sim_tau"),
                       "val_window": meta.get("val_answer_window"), "val_window_acc": meta.get("val_window_accuracies"),
                       "val_window_sim_tau": meta.get("val_window_sim_tau"),
                       "tau_chain3": res["tau"], "speedup_chain3": res["speedup"]})
    out = root / "scaling"
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.md").write_text(scaling_table(points, args))
    _plot_scaling(points, out / "scaling.png")
    atomic_write_json(out / "scaling.json", points)


def scaling_table(points: list[dict], args) -> str:
    k = max(len(p["val_acc"] or []) for p in points)
    window = next((p["val_window"] for p in points if p.get("val_window")), None)
    lines = [f"chain-3 τ on the bundled eval ({args.scaling_eval_per_domain} prompts per domain, "
             f"{args.eval_tokens} new tokens, T = 0); validation top-1 per TTT step over whole answers"
             + (f", and step 1 and simulated τ over each answer's first {window} tokens" if window else "")
             + "; every subset trained for as many steps as the full set (more epochs)", "",
             "| train answer tokens | epochs | " + " | ".join(f"val acc@{j + 1}" for j in range(k)) + " | sim τ (val) | "
             + (f"val acc@1 (first {window}) | sim τ (first {window}) | " if window else "")
             + "τ chain 3 | speedup chain 3 |", "|---" * (k + 5 + 2 * bool(window)) + "|"]
    for p in points:
        acc = " | ".join(f"{a:.3f}" for a in p["val_acc"] or [])
        win = ""
        if window:
            w = p.get("val_window_acc")
            win = f"{w[0]:.3f} | {p['val_window_sim_tau']:.2f} | " if w else "– | – | "
        lines.append(f"| {p['answer_tokens']:,} | {p.get('epochs', '–')} | {acc} | {p['val_sim_tau'] or 0:.2f} | {win}"
                     f"{p['tau_chain3']:.2f} | {p['speedup_chain3']:.2f}x |")
    return "\n".join(lines) + "\n"


def _plot_scaling(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    xs = [p["answer_tokens"] for p in points]
    for j in range(max(len(p["val_acc"] or []) for p in points)):
        a.plot(xs, [(p["val_acc"] or [0] * (j + 1))[j] for p in points], marker="o", label=f"step {j + 1}")
    a.set_xscale("log")
    a.set_xlabel("training answer tokens")
    a.set_ylabel("validation top-1")
    a.legend(fontsize=7)
    b.plot(xs, [p["tau_chain3"] for p in points], marker="o", label="τ chain 3 (eval)")
    b.plot(xs, [p["val_sim_tau"] or 0 for p in points], marker="s", label="simulated τ (val)")
    b.set_xscale("log")
    b.set_xlabel("training answer tokens")
    b.set_ylabel("τ")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _package(run: Run, root: Path, head: Path, features: Path, evald: Path, args) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    from draftheads.heads.base import WEIGHTS_NAME

    res = json.loads((evald / "results.json").read_text())
    tau = res["modes"]["chain3"]["overall"]["tau"]
    shipped = ROOT / args.package_dir
    old = shipped / "card.json"
    if old.is_file() and not args.force:
        prev = json.loads(old.read_text())["eval"]["chain3"]["tau"]
        if tau <= prev:
            run.say(f"package: chain-3 tau {tau:.3f} does not beat the committed head's {prev:.3f}: not replaced "
                    "(--force to replace it anyway)")
            atomic_write_json(root / "packaged.json", {"packaged": False, "tau": tau, "committed": prev})
            return
    meta = json.loads((head / "config.json").read_text())
    weights = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v)
               for k, v in load_file(str(head / WEIGHTS_NAME)).items()}
    card = {
        "command": this_command(),
        "date": time.strftime("%Y-%m-%d"),
        "machine_plain_tok_s": run.times.get("plain_tok_s"),
        "stage_seconds": {k: v for k, v in run.times.items() if k not in ("plain_tok_s", "running", "machines")},
        "stage_machines_plain_tok_s": run.times.get("machines", {}),
        "data": (data := {**feature_tokens(features), "from_answer": args.from_answer}),
        "val": {"accuracies": meta.get("val_accuracies"), "sim_tau": meta.get("val_sim_tau"),
                "draft_vocab_coverage": meta.get("draft_vocab_coverage"),
                "draft_vocab_size": meta["config"]["draft_vocab_size"]},
        "eval": {m: {"tau": v["overall"]["tau"], "alpha": v["overall"]["alpha"], "speedup": v["overall"]["speedup"],
                     "greedy_mismatches": v["overall"]["greedy_mismatches"],
                     "domains": {d: x["tau"] for d, x in v["domains"].items()}}
                 for m, v in res["modes"].items()},
        "eval_command": res["command"],
        "lineage": lineage(root, args, data["train"]["answer_tokens"]),
        "bench": None,  # the bench stage, after this one, fills it in
    }
    tmp = root / "package"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file(weights, str(tmp / WEIGHTS_NAME), metadata={"head_type": meta["head_type"]})
    (tmp / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    write_card(tmp, card, root)
    if shipped.exists():
        shutil.rmtree(shipped)
    shipped.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tmp, shipped)
    size = (shipped / WEIGHTS_NAME).stat().st_size / 2**20
    run.say(f"package: wrote {args.package_dir} ({size:.1f} MB), chain-3 tau {tau:.3f}")
    atomic_write_json(root / "packaged.json", {"packaged": True, "tau": tau, "mb": size})


def write_card(where: Path, card: dict, root: Path) -> None:
    """``card.json`` and ``CARD.md`` of a packaged head, the tables taken from the run ``root``."""
    bench_md, scaling = root / "bench/results.md", root / "scaling/scaling.md"
    _write_card_file(where / "card.json", json.dumps(card, indent=2) + "\n")
    _write_card_file(where / "CARD.md", card_markdown(
        card, (root / "eval/results.md").read_text(), bench_md.read_text() if card["bench"] else "",
        scaling.read_text() if scaling.is_file() else ""))


def _write_card_file(path: Path, text: str) -> None:
    """A card file, naming paths inside the checkout from the checkout (the commands ran with absolute ones)."""
    atomic_write_text(path, text.replace(f"{ROOT}/", ""))


def _card_bench(run: Run, root: Path, bench: Path, args) -> None:
    """Add the bench to the card of the head this run packaged (none when it packaged none)."""
    packaged = root / "packaged.json"
    if not (packaged.is_file() and json.loads(packaged.read_text())["packaged"]):
        return
    shipped = ROOT / args.package_dir
    card = json.loads((shipped / "card.json").read_text())
    res = json.loads((bench / "results.json").read_text())
    card["bench"] = {"command": res["command"], "dtype": res.get("dtype"), "proposers": res["proposers"]}
    write_card(shipped, card, root)
    run.say(f"bench: added to {args.package_dir}/CARD.md")


def _card_scaling(run: Run, root: Path, features: Path, args) -> None:
    """Put the scaling curve on the shipped head's card when that head was trained on this run's data (the
    curve is about the data and the recipe, and it may finish after the head was packaged)."""
    shipped = ROOT / args.package_dir
    if not (shipped / "card.json").is_file():
        return
    card = json.loads((shipped / "card.json").read_text())
    points = json.loads((root / "scaling/scaling.json").read_text())
    if card.get("scaling", {}).get("points") == points or card["data"] != feature_tokens(features):
        return
    card["scaling"] = {"command": this_command(), "points": points}
    _write_card_file(shipped / "card.json", json.dumps(card, indent=2) + "\n")
    _write_card_file(shipped / "CARD.md", with_section((shipped / "CARD.md").read_text(), "Data scaling", (
        f"`{card['scaling']['command']}`\n\n{(root / 'scaling/scaling.md').read_text()}")))
    run.say(f"scaling: added to {args.package_dir}/CARD.md")


def with_section(md: str, title: str, body: str) -> str:
    """``md`` with its ``## title`` section (up to the next ``## `` heading) replaced by ``body``, or
    ``body`` appended under that heading."""
    head = f"## {title}\n"
    text = f"{head}\n{body.strip()}\n"
    if head not in md:
        return md.rstrip("\n") + "\n\n" + text
    before, _, after = md.partition(head)
    rest = after.find("\n## ")
    return before + text + (after[rest:] if rest >= 0 else "")


def card_markdown(card: dict, eval_md: str, bench_md: str, scaling_md: str) -> str:
    d = card["data"]
    machines = card.get("stage_machines_plain_tok_s", {})

    def on(stage: str) -> str:
        rates = machines.get(stage) or []
        return f" (machines at {' + '.join(f'{r:.1f}' for r in rates)} tok/s)" if len(rates) > 1 or (
            rates and rates[0] != card["machine_plain_tok_s"]) else ""

    times = ", ".join(f"{k} {v / 60:.1f} min{on(k)}" for k, v in card["stage_seconds"].items())
    val = card["val"]
    acc = " / ".join(f"{a:.3f}" for a in val["accuracies"] or [])
    cov = val["draft_vocab_coverage"] or {}
    lines = [
        "# smollm2-135m-eagle3: the reference EAGLE-3 head for SmolLM2-135M-Instruct", "",
        f"Built by `{card['command'].strip()}` on {card['date']}; load it with `--head reference`.", "",
        f"- machine: plain decode {card['machine_plain_tok_s']:.1f} tok/s at batch 1 (fp32, engine); stage times "
        f"(a stage that ran on other machines names their rates): {times}",
        f"- data: {d['train']['conversations']:,} train conversations, {d['train']['answer_tokens']:,} answer tokens "
        f"({d['train']['tokens']:,} with prompts); val {d.get('val', {}).get('conversations', 0):,} conversations, "
        f"{d.get('val', {}).get('answer_tokens', 0):,} answer tokens; all written by the target itself"
        + (f" (the store's answers from number {d['from_answer']:,} on, 0-based)" if d.get("from_answer") else ""),
        f"- validation: top-1 per TTT step {acc}; simulated τ {val['sim_tau'] or 0:.2f}; draft vocabulary "
        f"{val['draft_vocab_size']} tokens covering {100 * (cov.get('train') or 0):.1f}% of train and "
        f"{100 * (cov.get('val') or 0):.1f}% of validation targets", "",
    ]
    runs = card.get("lineage") or []
    if len(runs) > 1:
        lines += [f"Trained over {len(runs)} runs, each a warm restart from the head before it "
                  f"({sum(r['epochs'] or 0 for r in runs)} epochs in all):", "",
                  *[f"{i}. {r['date']}: `{r['command']}`, {r['epochs'] or '?'} epoch{'' if r['epochs'] == 1 else 's'}"
                    + (f" on {r['answer_tokens']:,} answer tokens" if r.get("answer_tokens") else "")
                    for i, r in enumerate(runs, 1)],
                  ""]
    lines += ["## Eval (bundled eval prompts, T = 0, batch 1; mode per row)", "", eval_md.strip(), ""]
    if card["bench"]:
        lines += [f"## Bench (side by side in one run, target and head in {card['bench'].get('dtype') or 'float32'})",
                  "", bench_md.strip(), ""]
    else:
        lines += ["## Bench", "", "Not measured yet: the `bench` stage of the command above adds it.", ""]
    if scaling_md:
        lines += ["## Data scaling", "", scaling_md.strip(), ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
