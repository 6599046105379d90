"""A recipe file: one typed YAML that takes a target to a packaged head (see ``recipes/``).

Every section is a dataclass whose fields are documented here; :func:`load_recipe` checks the file
field by field and stops at the first wrong one with one line naming it and the fix. ``--set
section.field=value`` overrides a field from the command line (``heads.0.epochs=2``).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from draftheads.errors import DraftheadsError


@dataclass
class Data:
    """What the target answers, and how its answers and hidden states are made."""

    prompts: list[str] = field(default_factory=lambda: ["bundled:train"])
    """prompt files (``{id, domain, turns}`` jsonl), or bundled:train"""
    limit_per_domain: int | None = None
    """at most this many of ``prompts`` per domain"""
    synthesize: int = 0
    """prompts the target writes itself and then answers too (0: none; needs a chat template); raising it
    on a finished run extends its data"""
    synthesize_options: dict = field(default_factory=dict)
    """more ``draftheads synthesize`` flags, e.g. {multi_turn: 0.3, domains: [code, math], temperature: 0.8}"""
    max_new_tokens: int = 256
    """answer length"""
    max_seq_len: int = 1024
    """tokens per conversation and per training row"""
    batch_size: int = 64
    """rows generated together"""
    dtype: str = "float32"
    """dtype of synthesize, distill, features and bench (auto: bfloat16 where the hardware computes it
    natively, 2-3x faster than float32 on a CPU with AVX512-BF16; the eval stays float32)"""
    engine: str = "draftheads"
    """draftheads (continuous batching here) or vllm (features through its extract_hidden_states)"""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism"""
    data_parallel_size: int = 1
    """vLLM data parallelism"""
    features: str = "cache"
    """cache: the target's hidden states are written once (by distill's own pass, or a pass over the
    stored text) and training reads them; online: training runs the frozen target itself (large targets,
    whose cache would not fit on disk)"""
    val_fraction: float = 0.05
    """conversations held out to validate the heads on"""
    store: str | None = None
    """a directory that keeps the text the target writes as it grows, and seeds a run that lacks it
    (committed or mounted; the features are then cached in a pass of their own)"""
    from_answer: int = 0
    """cache features for, and train on, the distilled answers from this one on (0-based)"""

    def check(self) -> None:
        _at_least(self, "synthesize", 0)
        _at_least(self, "max_new_tokens", 1)
        _at_least(self, "max_seq_len", 2)
        _at_least(self, "batch_size", 1)
        _at_least(self, "from_answer", 0)
        _choice(self, "engine", ("draftheads", "vllm"))
        _choice(self, "features", ("cache", "online"))
        _choice(self, "dtype", ("auto", "float32", "bfloat16", "float16"))
        if not 0 <= self.val_fraction < 1:
            raise RecipeError("data.val_fraction", f"{self.val_fraction} must be in [0, 1)")
        if not self.prompts and not self.synthesize:
            raise RecipeError("data.prompts", "is empty and data.synthesize is 0: give prompt files or synthesize some")


@dataclass
class Head:
    """One head family trained on the recipe's features."""

    family: str
    """eagle3 | eagle | medusa | dflash | dspark"""
    config: str
    """the ``train-head`` YAML (its paths are moved under the run directory)"""
    epochs: int | None = None
    """max_epochs of the first fit (default: the config's)"""
    rounds: list[int] = field(default_factory=list)
    """further fits, each this many epochs from the head before it with a fresh warmup (a warm restart)"""
    init_head: str | None = None
    """start the first fit from this head directory (reference: the shipped head) instead of a new one"""
    restart_lr: float | None = None
    """peak learning rate of every fit that starts from a trained head (default: the config's)"""
    precision: str | None = None
    """Lightning precision (default: the config's; auto: bf16-mixed where bf16 is native, else 32)"""
    model: dict = field(default_factory=dict)
    """overrides of the config's model init_args"""
    trainer: dict = field(default_factory=dict)
    """overrides of the config's trainer"""
    data: dict = field(default_factory=dict)
    """overrides of the config's data section (batch_size, num_workers, ...)"""
    modes: list[str] = field(default_factory=list)
    """eval modes of this head beside the others (``compare``; default: the recipe's eval modes)"""

    def check(self, where: str) -> None:
        from draftheads.heads import FAMILIES

        _choice(self, "family", tuple(FAMILIES), where)
        if self.epochs is not None:
            _at_least(self, "epochs", 1, where)
        if any(not isinstance(r, int) or r < 1 for r in self.rounds):
            raise RecipeError(f"{where}.rounds", f"{self.rounds}: give epochs per round, each >= 1 (e.g. [2, 4])")


@dataclass
class Eval:
    """The acceptance and speed of the heads on held-out prompts (batch 1, T = 0, float32)."""

    prompts: str = "bundled:eval"
    """prompt file, or bundled:eval"""
    limit_per_domain: int = 2
    """prompts per domain"""
    max_new_tokens: int = 64
    """tokens per answer"""
    modes: list[str] = field(default_factory=lambda: ["auto", "chain3"])
    """tree modes: auto, chainK, small, medium, ..."""
    also: list[str] = field(default_factory=list)
    """other heads evaluated on the same prompts beside it (reference: the shipped head, when installed)"""

    def check(self) -> None:
        from draftheads.options import check_modes

        _at_least(self, "limit_per_domain", 1, "eval")
        _at_least(self, "max_new_tokens", 1, "eval")
        try:
            check_modes(tuple(self.modes), "eval.modes")
        except DraftheadsError as e:
            raise DraftheadsError(f"recipe field {e}") from None


@dataclass
class Bench:
    """Speed side by side in one run: every mode of the eval and auto at batch 1, and a batch sweep."""

    batches: list[int] = field(default_factory=lambda: [1, 4, 16])
    """batch sizes of the sweep"""
    repeats: int = 8
    """interleaved pairs per batch size"""


@dataclass
class Scaling:
    """Validation accuracy and chain-3 τ against training tokens, each point at the first fit's steps."""

    fractions: list[float] = field(default_factory=lambda: [0.125, 0.25, 0.5])
    """training fractions besides the whole set"""
    limit_per_domain: int = 3
    """eval prompts per domain of each point"""


@dataclass
class Arm:
    """One arm of the ablation: the first head's config with these overrides."""

    name: str
    """names the arm and its directory (``ablation/<name>``)"""
    model: dict = field(default_factory=dict)
    """overrides of the model init_args, e.g. {ttt_steps: 3}"""
    trainer: dict = field(default_factory=dict)
    """overrides of the trainer"""
    data: dict = field(default_factory=dict)
    """overrides of the data section"""
    features_dtype: str = ""
    """the dtype of the target's features the arm trains on (default: the run's data dtype); another one is
    cached once for the arms that ask for it (stage ``features-<dtype>``), from the same answers"""


@dataclass
class Ablation:
    """Arms of the first head trained for the same optimizer steps on the same rows from the same start, each
    ranked by walked τ (``draftheads walk``) on the eval's prompts; one stage per arm (``ablation-<name>``),
    the table rendered again as each lands."""

    arms: list[Arm] = field(default_factory=list)
    """the arms; the first is the baseline the others are read against"""
    steps: int = 400
    """optimizer steps of every arm"""
    val_every: int = 100
    """optimizer steps between validations"""
    modes: list[str] = field(default_factory=lambda: ["chain3", "small"])
    """walked modes"""
    limit_per_domain: int = 12
    """eval prompts per domain walked"""
    earlier: str = ""
    """an ablation table written before (its ``results.json``, e.g. the committed one): its arms are kept in this
    run's table where this run has not trained them, so arms run on other machines and days add up to one table"""

    def check(self) -> None:
        if not self.arms:
            raise RecipeError("ablation.arms", "is empty: give at least one arm (a name, and overrides)")
        _at_least(self, "steps", 1, "ablation")
        _at_least(self, "val_every", 1, "ablation")
        _at_least(self, "limit_per_domain", 1, "ablation")
        names = [a.name for a in self.arms]
        for i, n in enumerate(names):
            if not n or not all(c.isalnum() or c in "-_." for c in n):
                raise RecipeError(f"ablation.arms.{i}.name", f"{n!r}: use letters, digits, '-', '_' or '.'")
            if n in names[:i]:
                raise RecipeError(f"ablation.arms.{i}.name", f"{n!r} names another arm too: give each its own")
            if self.arms[i].features_dtype:
                _choice(self.arms[i], "features_dtype", ("float32", "bfloat16", "float16"), f"ablation.arms.{i}")
        from draftheads.options import check_modes

        if not self.modes or "auto" in self.modes:
            raise RecipeError("ablation.modes", f"{self.modes}: give fixed trees to walk (chain3, small, medium, ...)")
        try:
            check_modes(tuple(self.modes), "ablation.modes")
        except DraftheadsError as e:
            raise DraftheadsError(f"recipe field {e}") from None


@dataclass
class Package:
    """The first head in bfloat16 with its card, written only when it measures better than the one there."""

    dir: str
    """where the packaged head goes"""
    title: str = ""
    """the card's heading (default: the directory's name)"""
    mode: str = "chain3"
    """the eval mode whose τ decides whether the new head replaces the packaged one"""
    force: bool = False
    """package even when the packaged head measures better"""


@dataclass
class Serve:
    """vLLM serving the export, compared with this engine (skipped where vLLM is not installed)."""

    python: str = ".venv-vllm/bin/python"
    """python of vLLM's environment"""
    limit_per_domain: int = 1
    """eval prompts per domain"""


@dataclass
class Recipe:
    """A target, the data it writes, the heads trained on it, and how they are judged and shipped."""

    name: str
    """names the run: a run directory made by another recipe is refused"""
    target: str = "smollm2-135m"
    """the embedded default, a Hugging Face id, a local directory or a GGUF file"""
    device: str = "auto"
    """auto (cuda when present), cpu, cuda"""
    run_dir: str = ""
    """where everything goes (default: runs/<name>)"""
    data: Data = field(default_factory=Data)
    heads: list[Head] = field(default_factory=list)
    """the first is exported, evaluated and packaged; the others train on the same features and are
    evaluated and benched beside it"""
    eval: Eval = field(default_factory=Eval)
    bench: Bench | None = None
    scaling: Scaling | None = None
    ablation: Ablation | None = None
    serve: Serve | None = None
    package: Package | None = None

    def check(self) -> None:
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise RecipeError("name", f"{self.name!r}: use letters, digits, '-', '_' or '.'")
        if not self.heads:
            raise RecipeError("heads", "is empty: give at least one head family with its train-head config")
        self.data.check()
        for i, h in enumerate(self.heads):
            h.check(f"heads.{i}")
        self.eval.check()
        if self.ablation:
            self.ablation.check()
        if self.package and self.package.mode not in self.eval.modes:
            raise RecipeError("package.mode", f"{self.package.mode!r} is not among eval.modes {self.eval.modes}: "
                                              "add it there or choose one of them")

    @property
    def head(self) -> Head:
        """The head that is exported, evaluated and packaged."""
        return self.heads[0]


class RecipeError(DraftheadsError):
    def __init__(self, where: str, problem: str):
        super().__init__(f"recipe field {where}: {problem}")


def load_recipe(path: str | Path, overrides: list[str] = ()) -> Recipe:
    """The recipe at ``path`` with ``overrides`` (``key.path=yaml-value``), checked field by field."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DraftheadsError(f"recipe {path}: no such file (see recipes/ for examples)") from None
    except yaml.YAMLError as e:
        raise DraftheadsError(f"recipe {path}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(raw, dict):
        raise DraftheadsError(f"recipe {path}: expected a mapping of fields, got {type(raw).__name__}")
    for item in overrides:
        _override(raw, item)
    recipe = _build(Recipe, raw, "")
    recipe.check()
    return recipe


def _override(raw: dict, item: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise DraftheadsError(f"--set {item!r}: use field.path=value, e.g. heads.0.epochs=2")
    parts = key.split(".")
    node = raw
    for i, p in enumerate(parts[:-1]):
        nxt = node[int(p)] if isinstance(node, list) and p.isdigit() and int(p) < len(node) else (
            node.get(p) if isinstance(node, dict) else None)
        if nxt is None:
            if not isinstance(node, dict):
                raise DraftheadsError(f"--set {key}: {'.'.join(parts[:i + 1])} is not in the recipe")
            nxt = node[p] = {}
        node = nxt
    last = parts[-1]
    if isinstance(node, list):
        if not (last.isdigit() and int(last) < len(node)):
            raise DraftheadsError(f"--set {key}: index {last} is out of range (the list has {len(node)} items)")
        node[int(last)] = yaml.safe_load(value)
    else:
        node[last] = yaml.safe_load(value)


def _build(cls, raw, where: str):
    """``cls`` from the mapping ``raw``, each field checked against its annotation."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RecipeError(where or "(top)", f"expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            near = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"did you mean {near[0]}?" if near else f"known fields: {', '.join(fields)}"
            raise RecipeError(_join(where, key), f"unknown field; {hint}")
    kwargs = {}
    for name, f in fields.items():
        if name in raw:
            kwargs[name] = _value(hints[name], raw[name], _join(where, name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise RecipeError(_join(where, name), "is required")
    return cls(**kwargs)


def _value(hint, value, where: str):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _value(inner, value, where)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise RecipeError(where, f"expected a list, got {value!r}")
        return [_value(args[0], v, f"{where}.{i}") for i, v in enumerate(value)]
    if hint is dict:
        if not isinstance(value, dict):
            raise RecipeError(where, f"expected a mapping, got {value!r}")
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise RecipeError(where, f"expected {hint.__name__}, got {value!r}")
    return value


def _join(where: str, key) -> str:
    return f"{where}.{key}" if where else str(key)


def _at_least(obj, name: str, low: int, where: str = "data") -> None:
    if getattr(obj, name) < low:
        raise RecipeError(f"{where}.{name}", f"{getattr(obj, name)} must be >= {low}")


def _choice(obj, name: str, choices: tuple, where: str = "data") -> None:
    if getattr(obj, name) not in choices:
        raise RecipeError(f"{where}.{name}", f"{getattr(obj, name)!r}: use one of {', '.join(choices)}")
