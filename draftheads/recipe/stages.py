"""A recipe's stages, each the project's own command with the recipe's settings:

    synthesize -> distill -> features -> train -> extend -> export -> eval -> package -> bench -> compare
    -> scaling -> serve

``synthesize`` runs when the recipe asks the target to write prompts; ``extend`` when the first head has
rounds; ``package``, ``bench``, ``compare`` (the other heads), ``scaling`` and ``serve`` when their
sections are given. Layout of a run directory: ``data/`` (prompts and answers), ``features/``,
``main/`` (the first fit), ``extended``, ``extended2``, ... (rounds), ``<family>/`` (the other heads),
``export/<format>/``, ``eval/``, ``bench/``, ``compare/``, ``scaling/``, ``serve/``.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from draftheads.errors import DraftheadsError
from draftheads.recipe import ablation, scaling
from draftheads.recipe import package as pkg
from draftheads.recipe.config import Head, Recipe, RecipeError
from draftheads.recipe.runner import Stage, Step
from draftheads.utils import atomic_write_bytes, atomic_write_json, atomic_write_text, shown_from

LOADS_TARGET = ("synthesize", "distill", "cache-features", "export", "eval", "walk", "bench", "serve-check")
"""The ``draftheads`` commands of the stages that load the target (and so take ``--device``)."""
HEAD_READERS = ("export", "eval", "package", "bench", "serve")
"""The stages made from the first head alone: made again when its last round is to be made (``compare``
and ``scaling`` keep their own trained heads)."""


def native_dtype() -> str:
    """bfloat16 where the hardware computes it natively (a CUDA device with bf16, or a CPU oneDNN runs bf16
    kernels on), else float32: emulated bf16 is slower than float32."""
    import torch

    if torch.cuda.is_available():
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    native = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)()
    return "bfloat16" if native else "float32"


def round_dir(i: int) -> str:
    """The directory of extension round ``i`` (0-based): extended, extended2, extended3, ..."""
    return "extended" if i == 0 else f"extended{i + 1}"


def made_rounds(root: Path) -> list[Path]:
    """The extension rounds' directories under ``root``, in order (round 1, 2, ... while they follow on)."""
    out = []
    while (root / round_dir(len(out))).is_dir():
        out.append(root / round_dir(len(out)))
    return out


def trained_epochs(path: Path) -> int | None:
    """The epochs a fit directory was trained for (its train.yaml), None if it has none."""
    import yaml

    cfg = path / "train.yaml"
    return yaml.safe_load(cfg.read_text())["trainer"].get("max_epochs") if cfg.is_file() else None


def config_epochs(head: Head) -> int:
    """Epochs of a head's first fit: its ``epochs``, else its config's."""
    import yaml

    return head.epochs or yaml.safe_load(Path(head.config).read_text())["trainer"]["max_epochs"]


def run_epochs(head: Head) -> int:
    """Epochs a head trains in all: the first fit's and every round's."""
    return config_epochs(head) + sum(head.rounds)


def synthesized(synth: Path) -> int:
    """Prompts a finished synthesize output holds."""
    return json.loads(synth.with_name(synth.name + ".stats.json").read_text())["total"]


def grows(synth: Path, store, wanted: int) -> bool:
    """Whether the finished prompts a run starts from, its own ``synth`` or those the store seeds it with,
    are fewer than ``wanted`` (synthesize and distill then extend them, and training starts over)."""
    held = synth if synth.exists() else store.seeds("synthesize") if store else None
    return held is not None and synthesized(held) < wanted


@dataclass
class Plan:
    """A recipe resolved against a checkout: its paths, its settings and the commands of its stages.
    ``cwd``: where relative paths of the recipe start and commands run; ``command``: the command line."""

    recipe: Recipe
    cwd: Path
    command: str
    bin: Path = Path(sys.executable).parent
    dtype: str = ""

    def __post_init__(self):
        r = self.recipe
        self.root = self.path(r.run_dir or f"runs/{r.name}")
        self.dtype = self.dtype or (native_dtype() if r.data.dtype == "auto" else r.data.dtype)
        self.store = self.path(r.data.store) if r.data.store else None

    # ------------------------------------------------------------------ paths

    def path(self, p: str) -> Path:
        return (self.cwd / Path(p).expanduser()).absolute()

    def shown(self, p: Path) -> Path:
        return shown_from(p, self.cwd)

    @property
    def synth(self) -> Path:
        return self.root / "data/synth.jsonl"

    @property
    def answers(self) -> Path:
        return self.root / "data/train.jsonl"

    @property
    def features(self) -> Path:
        return self.root / "features"

    @property
    def head(self) -> Path:
        """The head the run exports, evaluates and packages: the last round's, else the first fit's."""
        rounds = self.recipe.head.rounds
        return self.root / (round_dir(len(rounds) - 1) if rounds else "main") / "head"

    def other(self, i: int) -> Path:
        """The directory of head ``i`` >= 1 of the recipe."""
        fam = self.recipe.heads[i].family
        same = [j for j, h in enumerate(self.recipe.heads) if h.family == fam and j >= 1]
        return self.root / (fam if len(same) == 1 else f"{fam}-{i}")

    def prompts(self) -> list[str]:
        """What distill answers: the recipe's prompt files and the synthesized ones."""
        r = self.recipe
        files = [p if p.startswith("bundled:") else str(self.path(p)) for p in r.data.prompts]
        return files + ([str(self.synth)] if r.data.synthesize else [])

    def answers_from(self) -> Path:
        """What the features stage reads: all answers, or (``from_answer`` > 0) a file of those from it on."""
        n = self.recipe.data.from_answer
        return self.answers if n == 0 else self.answers.with_name(f"{self.answers.stem}.from{n}.jsonl")

    def precision(self, head: Head) -> str | None:
        if head.precision == "auto":
            return "bf16-mixed" if native_dtype() == "bfloat16" else "32"
        return head.precision or None

    def check_layers(self) -> None:
        """A head whose config names target layers the target lacks stops here, in one line. The target's
        config is read (without its weights) only when some head names layers."""
        import yaml

        named = []
        for i, h in enumerate(self.recipe.heads):
            init = {**yaml.safe_load(self.path(h.config).read_text())["model"].get("init_args", {}), **h.model}
            named += [(i, key, init[key]) for key in ("aux_layer_ids", "target_layer_ids") if init.get(key)]
        if not named:
            return
        from draftheads.targets import text_config

        try:
            n = text_config(self.recipe.target).num_hidden_layers
        except (OSError, ValueError):
            return  # not readable here (a hub id offline): train-head checks the layers when it loads the target
        for i, key, ids in named:
            if min(ids) < 1 or max(ids) > n:
                raise RecipeError(f"heads.{i}.model.{key}", f"{list(ids)}: target {self.recipe.target} has {n} "
                                  f"layers (HF hidden-state ids 1..{n}); leave it out for the family's own layers")

    def layers(self) -> str:
        """The feature layers every head reads, as a spec of family names (``eagle3+dflash``)."""
        return "+".join(dict.fromkeys(h.family for h in self.recipe.heads))

    # ------------------------------------------------------------------ state

    @property
    def cached(self) -> bool:
        """Whether training reads a feature cache (else it runs the target itself on the answers)."""
        return self.recipe.data.features == "cache"

    @property
    def inputs(self) -> str:
        """The stage whose output the heads train on."""
        return "features" if self.cached else "distill"

    def same_pass(self) -> bool:
        """Whether distill captures the features in its own generation pass (no store: the store keeps text,
        whose features are then a pass of their own; and all answers are trained on)."""
        return self.cached and self.store is None and self.recipe.data.from_answer == 0

    def expected_answers(self) -> int | None:
        """Records a finished distill holds (None while the synthesized prompts are not finished)."""
        from draftheads.prompts import load_prompts

        d = self.recipe.data
        n = sum(len(load_prompts(p, limit_per_domain=d.limit_per_domain)) for p in self.prompts()
                if p != str(self.synth))
        if d.synthesize:
            if not self.synth.exists():
                return None
            n += synthesized(self.synth)
        return n

    def distilled_all(self) -> bool:
        if not self.answers.exists():
            return False
        with self.answers.open() as f:
            answered = sum(1 for line in f if line.strip())
        return answered == self.expected_answers()

    def grows(self, store) -> bool:
        return grows(self.synth, store, self.recipe.data.synthesize)

    def features_from(self) -> int:
        """The ``from_answer`` the run's feature cache was made with (0 where it has no record of one)."""
        f = self.root / "features-from.json"
        return json.loads(f.read_text())["from_answer"] if f.is_file() else 0

    # ------------------------------------------------------------------ commands

    def dh(self, *args) -> list[str]:
        """A ``draftheads`` command; those that load the target get the recipe's device."""
        device = ["--device", self.recipe.device] if self.recipe.device != "auto" and args[0] in LOADS_TARGET else []
        return [str(self.bin / "draftheads"), *map(str, args), *device]

    def fit_step(self, label: str, where: Path, head: Head, epochs: int | None = None, init: Path | None = None,
                 fraction: float = 1.0, trainer: dict | None = None) -> Step:
        """``train-head fit`` of ``head``'s config with its paths under ``where``, resumed from its last
        checkpoint when there is one."""
        cfg = where / "train.yaml"
        argv = [str(self.bin / "train-head"), "fit", "--config", str(cfg)]
        if (where / "train/checkpoints/last.ckpt").exists():
            argv += ["--ckpt_path", "last"]
        return Step(label, argv, prepare=lambda: self.write_config(where, head, epochs, init, fraction, trainer),
                    done=where / "head")

    def write_config(self, where: Path, head: Head, epochs: int | None, init: Path | None, fraction: float,
                     trainer: dict | None) -> None:
        from draftheads.training.cli import config_under, save_config

        epochs = epochs or head.epochs
        prec = self.precision(head)
        tr = {**({"precision": prec} if prec else {}), **({"max_epochs": epochs} if epochs else {}),
              **head.trainer, **(trainer or {})}
        model = {"target": self.recipe.target, **head.model}
        if init is not None:
            model |= {"init_head": str(init), **({"lr": head.restart_lr} if head.restart_lr else {})}
        data = {**head.data, **({"train_fraction": fraction} if fraction < 1 else {})}
        if not self.cached:
            data |= {"feature_dir": None, "train_files": [str(self.answers_from())],
                     "max_length": self.recipe.data.max_seq_len, "val_fraction": self.recipe.data.val_fraction}
        cfg = config_under(self.path(head.config), where, self.features, trainer=tr, model=model, data=data or None)
        for logger in cfg["trainer"].get("logger") or []:
            if logger["class_path"].endswith("WandbLogger"):
                fit = where.relative_to(self.root) if where.is_relative_to(self.root) else where.name
                logger["init_args"]["name"] = f"{self.recipe.name}-{fit}".replace("/", "-")
        save_config(cfg, where / "train.yaml", f"{head.config} by recipe {self.recipe.name}")

    def init_dir(self) -> Path | None:
        spec = self.recipe.head.init_head
        if not spec:
            return None
        from draftheads.heads.base import resolve_head

        path = resolve_head(spec)
        return path if path.is_absolute() else self.path(str(path))

    def eval_step(self, label: str, head: str | Path, out: Path, modes: list[str], per_domain: int | None = None,
                  command: str = "eval") -> Step:
        """``draftheads eval`` of ``head`` on the recipe's eval prompts (``command="walk"``: its walked τ)."""
        e = self.recipe.eval
        prompts = e.prompts if e.prompts.startswith("bundled:") else str(self.path(e.prompts))
        return Step(label, self.dh(command, "--target", self.recipe.target, "--head", head, "--prompts", prompts,
                                   "--limit-per-domain", per_domain or e.limit_per_domain, "--max-new-tokens",
                                   e.max_new_tokens, "--tree", ",".join(modes), "--out", out),
                    done=out / "results.json")

    # ------------------------------------------------------------------ the stages

    def stages(self) -> list[Stage]:
        r, d = self.recipe, self.recipe.data
        out: list[Stage] = []
        engine = [] if d.engine == "draftheads" else ["--engine", "vllm", "--tensor-parallel-size",
                                                       d.tensor_parallel_size, "--data-parallel-size",
                                                       d.data_parallel_size]
        if d.synthesize:
            n = d.synthesize
            out.append(Stage("synthesize", self.synth, [Step("synthesize", self.dh(
                "synthesize", "--target", r.target, "--num-prompts", n, "--batch-size", d.batch_size, "--round-size",
                min(192, 2 * n), "--dtype", self.dtype, *engine, *flags(d.synthesize_options), "--out", self.synth,
                "--extend"))],
                describe=f"the target writes {n} prompts",
                check=lambda: self.synth.exists() and synthesized(self.synth) >= n))
        same = ["--features", self.layers(), "--feature-dir", self.features, "--val-fraction", d.val_fraction] \
            if self.same_pass() else []
        limit = ["--limit-per-domain", d.limit_per_domain] if d.limit_per_domain else []
        out.append(Stage("distill", self.answers, [Step("distill", self.dh(
            "distill", "--target", r.target, "--prompts", *self.prompts(), *limit, "--max-new-tokens", d.max_new_tokens,
            "--batch-size", d.batch_size, "--dtype", self.dtype, "--max-seq-len", d.max_seq_len, *engine, *same,
            "--out", self.answers, "--extend"))],
            describe="the target answers the prompts" + (", its hidden states captured in the same pass" if same else ""),
            needs=("synthesize",) if d.synthesize else (), check=self.distilled_all))
        if self.cached:
            out.append(self.features_stage("features", self.features, self.dtype, made_by_distill=bool(same)))
        head = r.head
        init = self.init_dir()
        out.append(Stage("train", self.root / "main/head", [self.fit_step("train", self.root / "main", head, init=init)],
                         describe=f"{head.family} from {head.config}" + (f", on from {head.init_head}" if init else ""),
                         needs=(self.inputs,), before=self._before_training))
        if head.rounds:
            steps, start = [], self.root / "main/head"
            for i, epochs in enumerate(head.rounds):
                where = self.root / round_dir(i)
                steps.append(self.fit_step("extend" if i == 0 else f"extend round {i + 1}", where, head, epochs, start))
                start = where / "head"
            out.append(Stage("extend", self.head, steps, describe=f"rounds of {head.rounds} epochs, each a warm restart",
                             needs=("train",), grown=(self.root / round_dir(0) / "head").exists()))
        fit = "extend" if head.rounds else "train"
        exports = [Step(f"export {f}", self.dh("export", "--head", self.head, "--format", f, "--out",
                                               self.root / "export" / f, "--verifier", r.target),
                        done=self.root / "export" / f) for f in self.formats()]
        out.append(Stage("export", self.root / "export", exports, needs=(fit,), check=_all_done(exports)))
        evals = [self.eval_step("eval", self.head, self.root / "eval", r.eval.modes)]
        for name in r.eval.also:
            if _head_present(name, self.path):
                evals.append(self.eval_step(f"eval {name}", name, self.root / f"eval-{slug(name)}", r.eval.modes))
        out.append(Stage("eval", self.root / "eval/results.json", evals, needs=(fit,), check=_all_done(evals),
                         also=[s.done.parent for s in evals]))
        if r.package:
            out.append(Stage("package", self.root / "packaged.json", after=self._package, needs=(fit, "eval"),
                             describe=f"the head in bfloat16 to {r.package.dir} with its card, when its "
                                      f"{r.package.mode} τ beats the packaged one's"))
        if r.bench:
            out.append(Stage("bench", self.root / "bench/results.json", [Step("bench", self.bench_argv(
                {head.family: self.head}, ["auto", *r.eval.modes], self.root / "bench"))], after=self._card_bench,
                needs=(fit,), also=[self.root / "bench"]))
        if len(r.heads) > 1:
            out.append(self.compare_stage(fit))
        if r.scaling:
            out.append(self.scaling_stage())
        if r.ablation:
            out.extend(self.ablation_stages())
        if r.serve:
            out.append(self.serve_stage(fit))
        return out

    def formats(self) -> list[str]:
        from draftheads.export.vllm import EXPORTS

        fam = self.recipe.head.family
        return [f for f, spec in EXPORTS.items() if spec.head_type == fam][:1]

    def bench_argv(self, heads: dict[str, Path], modes: list[str], out: Path) -> list[str]:
        b = self.recipe.bench
        return self.dh("bench", "--target", self.recipe.target, *[a for fam, h in heads.items() for a in (f"--{fam}", h)],
                       "--tree", ",".join(dict.fromkeys(modes)), "--only", "proposers,batch", "--max-new-tokens",
                       self.recipe.eval.max_new_tokens, "--batches", ",".join(map(str, b.batches)), "--batch-repeats",
                       b.repeats, "--dtype", self.dtype, "--out", out)

    def compare_stage(self, fit: str) -> Stage:
        """The other heads on the same features, each evaluated like the first, all benched side by side."""
        r = self.recipe
        steps, heads = [], {r.head.family: self.head}
        for i, h in enumerate(r.heads[1:], 1):
            where = self.other(i)
            steps.append(self.fit_step(f"compare {where.name}", where, h))
            heads[where.name] = where / "head"
        for name, h in heads.items():
            steps.append(self.eval_step(f"compare eval {name}", h, self.root / "compare" / f"eval-{name}",
                                        self.compare_modes()))
        if r.bench:
            fams = {r.heads[i].family: self.other(i) / "head" for i in range(1, len(r.heads))}
            steps.append(Step("compare bench", self.bench_argv(
                {r.head.family: self.head, **fams}, ["auto", *(m for m in self.compare_modes() if m != "chain3")],
                self.root / "compare/bench"), done=self.root / "compare/bench/results.json"))
        return Stage("compare", self.root / "compare/results.json", steps, after=self._compare(heads),
                     needs=(self.inputs, fit), also=[self.other(i) for i in range(1, len(r.heads))],
                     describe="the other heads, trained on the same features")

    def compare_modes(self) -> list[str]:
        """The modes every head is evaluated in side by side: those the other heads name, else the eval's."""
        named = [m for h in self.recipe.heads[1:] for m in h.modes]
        return list(dict.fromkeys(named or self.recipe.eval.modes))

    def scaling_stage(self) -> Stage:
        s, head = self.recipe.scaling, self.recipe.head
        steps = []
        for f, name in self.scaling_points():
            if f < 1.0 or name != "main":  # the first fit is the whole-data point, unless it started from a head
                steps.append(self.fit_step(f"scaling {f:g}", self.root / name, head, fraction=f,
                                           trainer=scaling.schedule(config_epochs(head), f) if f < 1 else None))
            steps.append(self.eval_step(f"scaling eval {f:g}", self.root / name / "head",
                                        self.root / name / "eval-chain3", ["chain3"], s.limit_per_domain))
        return Stage("scaling", self.root / "scaling/scaling.json", steps, after=self._scaling,
                     needs=(self.inputs, "train"), also=[self.root / "scaling", self.root / "main/eval-chain3"],
                     describe="validation accuracy and chain-3 τ against training tokens at equal compute")

    def features_stage(self, name: str, where: Path, dtype: str, made_by_distill: bool = False) -> Stage:
        """The target's hidden states over the answers from ``data.from_answer`` on, in ``dtype``."""
        d = self.recipe.data
        return Stage(name, where / "index.json", [Step(name, self.dh(
            "cache-features", "--target", self.recipe.target, "--data", self.answers_from(), "--layers",
            self.layers(), "--out", where, "--max-length", d.max_seq_len, "--val-fraction", d.val_fraction,
            "--dtype", dtype, "--overwrite"), prepare=self._slice)],
            describe=f"the target's hidden states at the heads' layers, in {dtype}"
                     + (" (made by distill)" if made_by_distill else ""), needs=("distill",))

    def ablation_stages(self) -> list[Stage]:
        """One stage per arm: the first head with the arm's overrides, trained for the ablation's steps from
        the same start, then walked; each renders the table of the arms finished so far. Features in
        another dtype than the run's are a stage of their own, made once for the arms that read them."""
        a, head = self.recipe.ablation, self.recipe.head
        trainer = {"max_steps": a.steps, "max_epochs": -1, "val_check_interval": a.val_every,
                   "check_val_every_n_epoch": None}
        out = []
        for dtype in dict.fromkeys(arm.features_dtype for arm in a.arms):
            if dtype and dtype != self.dtype:
                out.append(self.features_stage(f"features-{dtype}", self.root / f"features-{dtype}", dtype))
        for arm in a.arms:
            where = self.root / "ablation" / arm.name
            own = arm.features_dtype if arm.features_dtype and arm.features_dtype != self.dtype else ""
            data = {**head.data, **arm.data, **({"feature_dir": str(self.root / f"features-{own}")} if own else {})}
            h = replace(head, rounds=[], model={**head.model, **arm.model}, trainer={**head.trainer, **arm.trainer},
                        data=data)
            steps = [self.fit_step(f"ablation {arm.name}", where, h, trainer=trainer),
                     self.eval_step(f"ablation walk {arm.name}", where / "head", where / "walk", a.modes,
                                    a.limit_per_domain, command="walk")]
            out.append(Stage(f"ablation-{arm.name}", where / "walk/results.json", steps, after=self._ablation,
                             needs=(self.inputs,) + ((f"features-{own}",) if own else ()), also=[where],
                             describe=f"{arm.name}: {a.steps} steps, walked {','.join(a.modes)}"
                                      + (f", on features in {own}" if own else "")))
        return out

    def scaling_points(self) -> list[tuple[float, str]]:
        fractions = sorted(self.recipe.scaling.fractions) + [1.0]
        return [(f, "main" if f == 1.0 and not self.recipe.head.init_head else f"scaling/f{f:g}") for f in fractions]

    def serve_stage(self, fit: str) -> Stage:
        s, r = self.recipe.serve, self.recipe
        python = self.path(s.python)
        skip = "" if python.is_file() else f"vLLM not installed (no {self.shown(python)}; `make vllm-check` builds it)"
        e = r.eval
        prompts = e.prompts if e.prompts.startswith("bundled:") else str(self.path(e.prompts))
        k = next((int(m[5:]) for m in e.modes if m.startswith("chain")), 3)  # served as the eval's chain
        return Stage("serve", self.root / "serve/results.json", [Step("serve", self.dh(
            "serve-check", "--target", r.target, f"--{r.head.family}", self.head, "--formats", ",".join(self.formats()),
            "--k", k, "--vllm-python", python, "--prompts", prompts, "--limit-per-domain", s.limit_per_domain,
            "--max-tokens", e.max_new_tokens, "--out", self.root / "serve"))],
            needs=(fit,), skip=skip, describe="vLLM serves the export; its τ, α per position and text against this engine's")

    # ------------------------------------------------------------------ in-process work

    def _slice(self) -> None:
        """Write the answers from ``from_answer`` on and record it beside the feature cache."""
        n, sliced = self.recipe.data.from_answer, self.answers_from()
        if sliced != self.answers:
            lines = self.answers.read_bytes().splitlines(keepends=True)
            if n >= len(lines):
                raise DraftheadsError(f"recipe field data.from_answer: {n}, but {self.shown(self.answers)} holds "
                                      f"{len(lines)} answers; give a smaller one")
            atomic_write_bytes(sliced, b"".join(lines[n:]))
        atomic_write_json(self.root / "features-from.json", {"from_answer": n})

    def _before_training(self) -> None:
        """Online, the answers it trains on; and the card of the head the first fit starts from, kept for the
        lineage (before package replaces it)."""
        if not self.cached:
            self._slice()
        init = self.init_dir()
        if init is None:
            return
        if not (init / "config.json").is_file():
            raise DraftheadsError(f"recipe field heads.0.init_head: no head in {self.shown(init)}; give a head "
                                  "directory, or reference once a head is shipped")
        (self.root / "main").mkdir(parents=True, exist_ok=True)
        if (init / "card.json").is_file() and not (self.root / "main/init-card.json").exists():
            shutil.copy(init / "card.json", self.root / "main/init-card.json")

    def packaging(self) -> pkg.Packaging:
        p = self.recipe.package
        where = self.path(p.dir)
        from draftheads.heads.base import shipped_head_path

        load_as = "--head reference" if where == shipped_head_path("reference").absolute() else ""
        return pkg.Packaging(self.root, where, p.title, p.mode, self.command, self.cwd, load_as)

    def trained_on(self) -> dict:
        """What the heads trained on: per split, conversations and (from a feature cache) answer tokens."""
        if self.cached:
            data = pkg.feature_tokens(self.features)
        else:
            with self.answers_from().open() as f:
                data = {"train": {"conversations": sum(1 for line in f if line.strip()), "answer_tokens": None,
                                  "tokens": None}}
        return data | {"from_answer": self.recipe.data.from_answer}

    def _package(self, times: dict, say) -> None:
        pkg.package(self.packaging(), self.head, self.trained_on(), self.root / "eval", times,
                    run_epochs(self.recipe.head), self.recipe.package.force, say)

    def _card_bench(self, times: dict, say) -> None:
        if self.recipe.package:
            pkg.card_bench(self.packaging(), self.root / "bench", say)

    def _compare(self, heads: dict[str, Path]):
        def after(times: dict, say) -> None:
            table = {n: json.loads((self.root / "compare" / f"eval-{n}" / "results.json").read_text())["modes"]
                     for n in heads}
            atomic_write_json(self.root / "compare/results.json", {
                n: {m: {"tau": v["overall"]["tau"], "speedup": v["overall"]["speedup"]} for m, v in modes.items()}
                for n, modes in table.items()})
        return after

    def _scaling(self, times: dict, say) -> None:
        s, head = self.recipe.scaling, self.recipe.head
        tokens = pkg.feature_tokens(self.features)["train"]["answer_tokens"]
        points = []
        for f, name in self.scaling_points():
            meta = json.loads((self.root / name / "head/config.json").read_text())
            res = json.loads((self.root / name / "eval-chain3/results.json").read_text())["modes"]["chain3"]["overall"]
            epochs = scaling.schedule(config_epochs(head), f)["max_epochs"] if f < 1 else config_epochs(head)
            points.append(scaling.point(f, tokens, epochs, meta, res))
        out = self.root / "scaling"
        out.mkdir(parents=True, exist_ok=True)
        (out / "scaling.md").write_text(scaling.table(points, s.limit_per_domain, self.recipe.eval.max_new_tokens))
        scaling.plot(points, out / "scaling.png")
        atomic_write_json(out / "scaling.json", points)
        if self.recipe.package:
            pkg.card_scaling(self.packaging(), self.features, say)

    def _ablation(self, times: dict, say) -> None:
        a, out = self.recipe.ablation, self.root / "ablation"
        earlier = ablation.earlier_rows(self.recipe, self.path(a.earlier), self.cwd) if a.earlier else {}
        rows, kept = [], 0
        for arm in a.arms:
            if (out / arm.name / "walk/results.json").is_file():
                rows.append(ablation.row(arm, out / arm.name, self.cwd,
                                         times.get("machines", {}).get(f"ablation-{arm.name}")))
            elif arm.name in earlier:
                rows.append(earlier[arm.name])
                kept += 1
        res = ablation.results(self.recipe, rows, self.shown(out))
        atomic_write_json(out / "results.json", res)
        atomic_write_text(out / "results.md", ablation.markdown(res))
        say(f"ablation: {len(rows)} of {len(a.arms)} arms in {self.shown(out / 'results.md')}"
            + (f", {kept} of them kept from {a.earlier}" if kept else ""))


def flags(options: dict) -> list[str]:
    """``{name: value}`` as command-line flags (``--name value``; a list as its items, True as the flag alone)."""
    out = []
    for k, v in options.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v not in (False, None):
            out += [flag, *(map(str, v) if isinstance(v, list) else [str(v)])]
    return out


def _all_done(steps: list[Step]):
    return lambda: all(s.done.exists() for s in steps)


def slug(name: str) -> str:
    """A head spec as a directory name (``reference``, or a head directory's own name)."""
    return Path(name).name or "head"


def _head_present(spec: str, path) -> bool:
    """Whether ``spec`` names a head that is there (a shipped one installed, or a directory)."""
    from draftheads.heads.base import resolve_head

    try:
        where = resolve_head(spec)
    except DraftheadsError:
        return False
    where = where if where.is_absolute() else path(str(where))
    return (where / "config.json").is_file()
