"""``draftheads recipe run FILE``: a recipe's stages in order, through the one stage runner.

A rerun skips finished stages and resumes the unfinished one (synthesize and distill after their last
committed round or shard, training from its last checkpoint); raising ``data.synthesize`` on a finished
run extends the data and trains again; ``--redo`` makes stages again (and the ones after them), ``--only``
runs some and leaves the others, refusing when a stage it runs reads one that is neither finished nor
run; ``--dry-run`` prints every stage's commands and settings without loading a model.
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

from draftheads.recipe.config import load_recipe
from draftheads.recipe.runner import Run, Stage, check_names, claim, order_redo, owner_problem, unmet_need
from draftheads.recipe.stages import HEAD_READERS, Plan, made_rounds, slug, synthesized, trained_epochs
from draftheads.recipe.store import STORED, DataStore

ACTIONS = ("run", "fits")
"""run: every stage; fits: write the training configs of the unfinished fits of the stages in ``--only``
(default train,extend) and print their paths in order, for a cluster job to run (scripts/slurm_train.sbatch)."""


def run_recipe(path: str, overrides: list[str] = (), redo: str = "", only: str = "", dry_run: bool = False,
               cwd: Path | None = None) -> int:
    recipe = load_recipe(path, overrides)
    cwd = (cwd or Path.cwd()).absolute()
    command = shlex.join(["draftheads", "recipe", "run", str(path), *(a for o in overrides for a in ("--set", o))])
    plan = Plan(recipe, cwd, command)
    plan.check_layers()
    stages = plan.stages()
    names = [s.name for s in stages]
    redo_set = set(names) if redo == "all" else {s for s in redo.split(",") if s}
    only_set = frozenset(s for s in only.split(",") if s)
    check_names(names, redo_set, "--redo")
    check_names(names, set(only_set), "--only")
    owner = {"recipe": recipe.name, "target": recipe.target}
    if dry_run:
        print_plan(plan, stages, order_redo(names, redo_set), only_set, owner_problem(plan.root, owner))
        return 0
    claim(plan.root, owner)
    run = Run(plan.root, cwd, plan.shown)
    store = DataStore(plan.store, plan.root / "data", plan.prompts()) if plan.store else None
    redo_set = reconcile(plan, run, store, stages, redo_set)
    if need := unmet_need(stages, only_set, lambda n: n not in redo_set):  # refused before anything is removed
        raise SystemExit(f"error: --only {need[0]} reads what {need[1]} makes, and --redo makes {need[1]} again: "
                         f"add {need[1]} to --only, or leave it out of --redo")
    for s in stages:
        if s.name in redo_set:
            run.forget(s.name)
            for target in [s.done, *s.also, *(st.done for st in s.steps if st.done)]:
                if target.is_dir():
                    shutil.rmtree(target)
                elif target.exists():
                    target.unlink()
    if store:
        for s in redo_set & set(STORED):
            store.drop(s)  # a store seeding a later run with what this one makes again would undo the redo
    run.say(f"recipe {recipe.name}: {command}")
    if store:
        store.seed(run)
        run.on_tick.append(lambda: store.save(run.times))
    stages = plan.stages()  # what is finished, and where training resumes, after the removals
    done = {s.name: s.finished() for s in stages}
    if need := unmet_need(stages, only_set, lambda n: done.get(n, True)):
        raise SystemExit(f"error: --only {need[0]} reads what {need[1]} makes, and it is not finished: add it to "
                         "--only, or run without --only")
    if rate := plain_decode_rate():
        # measured at every start: a resumed run may be on another machine, and each stage lists the rates of
        # the machines it ran on
        run.times["plain_tok_s"] = round(rate, 2)
        run.save_times()
        run.say(f"machine: plain decode {rate:.1f} tok/s at batch 1 (fp32, engine, the default target)")
    run.say(f"data in {plan.dtype}; " + "; ".join(
        f"{h.family} trains in precision {plan.precision(h) or 'of its config'}" for h in recipe.heads)
        + "; eval in float32")
    for s in stages:
        execute(run, s, only_set)
    print(summary(plan))
    run.say(f"recipe {recipe.name}: {'stages ' + ','.join(s for s in names if s in only_set) if only_set else 'all stages'}"
            f" done; stage times {json.dumps(run.times)}")
    return 0


def write_fits(path: str, overrides: list[str] = (), only: str = "", cwd: Path | None = None) -> list[Path]:
    """The training configs of the unfinished fits of the stages ``only`` (default: train and extend),
    written under the run directory, in the order they must run."""
    recipe = load_recipe(path, overrides)
    plan = Plan(recipe, (cwd or Path.cwd()).absolute(), "")
    stages = plan.stages()
    wanted = {s for s in only.split(",") if s} or {"train", "extend"}
    check_names([s.name for s in stages], wanted, "--only")
    claim(plan.root, {"recipe": recipe.name, "target": recipe.target})
    out = []
    for s in stages:
        if s.name not in wanted:
            continue
        if s.before:
            s.before()
        for step in s.steps:
            if step.argv[1:2] == ["fit"] and not step.done.exists():
                step.prepare()
                out.append(Path(step.argv[step.argv.index("--config") + 1]))
    return out


def reconcile(plan: Plan, run: Run, store, stages: list[Stage], redo: set[str]) -> set[str]:
    """``redo`` with what the run directory's state asks to make again: rounds trained for other epochs,
    features cached from another answer, data grown, and the stages after those."""
    r, names = plan.recipe, [s.name for s in stages]
    rounds = r.head.rounds
    made = made_rounds(plan.root)
    stale = next((i for i, d in enumerate(made) if i < len(rounds) and trained_epochs(d) != rounds[i]), None)
    if stale is not None:  # a round trained for other epochs: it and the rounds after it are made again
        run.say(f"extend: round {stale + 1} ({made[stale].name}) was trained for {trained_epochs(made[stale])} "
                f"epochs, not {rounds[stale]}: it and the rounds after it are made again")
        for d in made[stale:]:
            shutil.rmtree(d)
    if plan.features.exists() and (cached := plan.features_from()) != r.data.from_answer:
        run.say(f"features: cached from answer {cached} on, not data.from_answer {r.data.from_answer}: made again")
        redo.add("features")
    if "synthesize" in names and "synthesize" not in redo and plan.grows(store):
        held = plan.synth if plan.synth.exists() else store.seeds("synthesize")
        run.say(f"synthesize: {plan.shown(held)} holds {synthesized(held)} prompts, fewer than data.synthesize "
                f"{r.data.synthesize}: it and the distilled data are extended, and training starts over")
        # with a store, distill writes text only and the features are a pass of their own
        redo.add("features" if store else "train")
    redo = order_redo(names, redo)
    if rounds and not plan.head.exists():
        # the stages that read the exported head were made from the head before its last round
        redo |= set(HEAD_READERS) & set(names)
    return redo


def execute(run: Run, s: Stage, only: frozenset[str]) -> None:
    finished = s.finished()  # a check may read the stage's output (distill counts its answers): once
    if s.skip and not finished and (not only or s.name in only):
        run.say(f"=== {s.name}: skipped: {s.skip}")
        return

    def make():
        if s.before:
            s.before()
        for step in s.steps:
            if step.done is not None and step.done.exists():
                continue
            if step.prepare:
                step.prepare()
            run.cmd(step.label, step.argv)
        if s.after:
            s.after(run.times, run.say)

    run.stage(s.name, s.done, make, finished=finished, grown=s.grown, only=only)


def print_plan(plan: Plan, stages: list[Stage], redo: set[str], only: frozenset[str], problem: str) -> None:
    r = plan.recipe
    print(f"recipe {r.name}: target {r.target}, run directory {plan.shown(plan.root)}"
          + ("" if plan.root.exists() else " (new)"))
    if problem:
        print(f"error: {problem}")
    print(f"settings: data dtype {plan.dtype}, engine {r.data.engine}, feature layers {plan.layers()}, "
          f"max_seq_len {r.data.max_seq_len}; " + "; ".join(
              f"{h.family}: {h.config}, precision {plan.precision(h) or 'of its config'}" for h in r.heads))
    for i, s in enumerate(stages, 1):
        if only and s.name not in only:
            state = "not run (not in --only)"
        elif s.name in redo:
            state = "made again" if s.finished() else "runs"
        elif s.finished():
            state = "finished, reused"
        elif s.skip:
            state = f"skipped: {s.skip}"
        else:
            state = "runs"
        print(f"{i:2d}. {s.name} [{state}]" + (f": {s.describe}" if s.describe else ""))
        for step in s.steps:
            print("      " + " ".join(shlex.quote(_shown_arg(plan, a)) for a in step.argv))
        if s.after and not s.steps:
            print("      (in process)")


def _shown_arg(plan: Plan, arg: str) -> str:
    return arg.replace(f"{plan.cwd}/", "") if arg.startswith(str(plan.cwd)) else (
        Path(arg).name if arg.startswith(str(plan.bin)) else arg)


def summary(plan: Plan) -> str:
    """The eval of the run's head and of the heads beside it: one row per head and mode."""
    from draftheads.recipe.package import feature_tokens, trained_tokens

    r = plan.recipe
    evald = plan.root / "eval"
    if not (evald / "results.json").is_file():
        return ""
    label = "trained now"
    if (plan.features / "index.json").is_file():
        label += f" on {feature_tokens(plan.features)['train']['answer_tokens'] / 1e3:.1f} k tokens"
    rows = [(label, evald)]
    for name in r.eval.also:
        from draftheads.heads.base import resolve_head

        where = plan.root / f"eval-{slug(name)}"
        if (where / "results.json").is_file():
            card = resolve_head(name) / "card.json"
            rows.append((f"{name}, trained on {trained_tokens(json.loads(card.read_text()))} tokens"
                         if card.is_file() else name, where))
    lines = [(evald / "results.md").read_text(), "| head | mode | τ | α@1 | speedup |", "|---|---|---|---|---|"]
    for head, where in rows:
        for mode, m in json.loads((where / "results.json").read_text())["modes"].items():
            o = m["overall"]
            lines.append(f"| {head} | {mode} | {o['tau']:.2f} | {(o['alpha'] or [0.0])[0]:.2f} | {o['speedup']:.2f}x |")
    plots = sorted(str(plan.shown(f)) for f in evald.glob("*.png"))
    return "\n".join(lines) + "\n" + (f"plots: {', '.join(plots)}\n" if plots else "")


def plain_decode_rate(tokens: int = 64) -> float | None:
    """Batch-1 greedy tokens/s of the default target in the engine (fp32), the machine's yardstick (None
    where the default target is not installed)."""
    from draftheads.errors import DraftheadsError
    from draftheads.inference.engine import Engine
    from draftheads.inference.sampling import SamplingParams
    from draftheads.prompts import encode_chat
    from draftheads.targets import load_target

    try:
        t = load_target("smollm2-135m")
    except DraftheadsError:
        return None
    ids = encode_chat(t.tokenizer, [{"role": "user", "content": "Explain how a bicycle works."}])
    engine = Engine(t.model, t.tokenizer)
    engine.generate([ids[:8]], SamplingParams(max_new_tokens=2))
    (out,) = engine.generate([ids], SamplingParams(max_new_tokens=tokens, stop_at_eos=False))
    return out.metrics.tokens_per_s

