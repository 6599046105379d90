"""Command-line options, declared once: option groups as typed dataclasses, subcommands as typed functions.

A subcommand is a function. Its plain parameters are its own flags, documented in the docstring's
``Args:``. A parameter typed with an option group (:class:`TargetOptions`, :class:`SamplingOptions`,
:class:`DrafterOptions`, :class:`EngineOptions`) adds that group's flags, spelled and documented the same
in every subcommand that takes it; a default instance on the parameter
(``sampling: SamplingOptions = SamplingOptions(temperature=1.0)``) sets the group's defaults for that
subcommand only. :func:`add_command` turns a function into a subparser and :func:`call` rebuilds its
arguments from the parsed namespace, so the groups' ``__post_init__`` checks run before anything loads.

Spelling: ``max_new_tokens`` is ``--max-new-tokens``; a ``bool`` is a switch (``--compare-plain``; a
default of True gives ``--no-<name>``); ``list[T]`` takes one or more values, or one comma-separated
value with ``Flag(sep=",")``; ``dict[str, str]`` with ``Flag(choices=...)`` is one flag per registry key.
Values are checked while parsing, so a bad one ends in argparse's one line naming the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, NewType

import docstring_parser

from draftheads.datagen.backends import DEFAULT_VLLM_PYTHON
from draftheads.errors import DraftheadsError
from draftheads.targets import DEFAULT_TARGET

CommandLine = NewType("CommandLine", str)
"""A parameter of this type receives the command as typed (``draftheads eval ...``), for result files."""


@dataclass(frozen=True)
class Flag:
    """How one parameter is spelled and checked: ``Annotated[int, Flag(low=1)]``."""

    name: str | None = None
    """The flag when it is not the parameter's name with dashes (``--from`` for ``source``)."""
    choices: str | None = None
    """``module:NAME`` of the registry whose keys are the valid values (read when the parser is built)."""
    low: float | None = None
    """The smallest valid value (of every item, for a list)."""
    sep: str | None = None
    """A list given as one argument split on this separator (``--ks 1,2,4``)."""
    positional: bool = False


# ---------------------------------------------------------------------------------------------- groups

@dataclass(frozen=True)
class LoadOptions:
    """how the model loads"""

    dtype: str = "float32"
    """float32 | bfloat16 | float16"""
    device: str = "auto"
    """auto (cuda when present), cpu, cuda or cuda:N"""
    trust_remote_code: bool = False
    """run the checkpoint's own modeling code from the hub"""
    threads: Annotated[int | None, Flag(low=1)] = None
    """torch CPU threads (default: torch's own choice)"""

    def torch_device(self):
        """``device`` as a torch device, checked against this machine."""
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except (RuntimeError, ValueError):
            raise DraftheadsError(f"--device {self.device!r} is not a device: use auto, cpu, cuda or cuda:N") from None
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise DraftheadsError(f"--device {self.device}: this machine has no CUDA device: use --device cpu")
            if device.index is not None and device.index >= torch.cuda.device_count():
                raise DraftheadsError(f"--device {self.device}: only {torch.cuda.device_count()} CUDA device(s) here")
        elif device.type != "cpu":
            raise DraftheadsError(f"--device {self.device}: use auto, cpu, cuda or cuda:N")
        return device

    def load(self, spec: str):
        """The target ``spec`` as a frozen :class:`~draftheads.targets.Target` with these options."""
        import torch

        from draftheads.targets import load_target

        device = self.torch_device()
        if self.threads:
            torch.set_num_threads(self.threads)
        return load_target(spec, dtype=self.dtype, device=device, trust_remote_code=self.trust_remote_code)


@dataclass(frozen=True)
class TargetOptions(LoadOptions):
    """the target model"""

    target: str = DEFAULT_TARGET
    """the embedded default, a Hugging Face id, a local directory or a GGUF file"""

    def load(self, spec: str | None = None):
        return super().load(spec or self.target)


@dataclass(frozen=True)
class SamplingOptions:
    """sampling (temperature 0 is greedy: token-identical to plain decoding)"""

    temperature: float = 0.0
    """0 = greedy"""
    top_p: float = 1.0
    """nucleus mass, in (0, 1]"""
    top_k: int = 0
    """keep the k most likely tokens (0 = all)"""
    seed: int = 0
    """seed of every sampled token (same seed, same output)"""

    def __post_init__(self):
        self.params(1)  # the sampling checks, before anything loads

    def params(self, max_new_tokens: int):
        from draftheads.inference.sampling import SamplingParams

        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=max_new_tokens, seed=self.seed)


def check_modes(modes: tuple[str, ...], flag: str = "--tree") -> tuple[str, ...]:
    """Distinct tree modes, each one parsed (a tree too large fails before drafting)."""
    from draftheads.inference.tree import parse_tree

    if not modes or len(set(modes)) != len(modes):
        raise DraftheadsError(f"{flag} {','.join(modes)!r}: give one or more distinct modes, e.g. auto,chain3")
    for m in modes:
        if m != "auto":
            parse_tree(m)
    return modes


@dataclass(frozen=True)
class DrafterOptions:
    """the drafter (no --head and no --proposer: plain decoding)"""

    head: str | None = None
    """head directory (train-head or draftheads import output)"""
    proposer: Annotated[str | None, Flag(choices="draftheads.inference.build:PROPOSERS")] = None
    """head-less proposer"""
    tree: Annotated[tuple[str, ...], Flag(sep=",")] = ("auto",)
    """auto (plain decoding or a tree each step, by measured throughput) | chainK (vLLM serves a chain of K) |
    small | medium | large | a static-tree JSON file (Medusa); a comma list where the command compares modes"""

    def __post_init__(self):
        check_modes(self.tree)

    def mode(self) -> str:
        if len(self.tree) > 1:
            raise DraftheadsError(f"--tree {','.join(self.tree)!r}: give one mode here (eval takes a list)")
        return self.tree[0]


@dataclass(frozen=True)
class EngineOptions:
    """who writes the text"""

    engine: Annotated[str, Flag(choices="draftheads.datagen.backends:ENGINES")] = "draftheads"
    """the project's engine (features captured in the generation pass) or vLLM (features through its
    extract_hidden_states)"""
    vllm_python: str = DEFAULT_VLLM_PYTHON
    """python of vLLM's environment"""
    tensor_parallel_size: Annotated[int, Flag(low=1)] = 1
    """vLLM tensor parallelism"""
    data_parallel_size: Annotated[int, Flag(low=1)] = 1
    """vLLM data parallelism"""
    pipeline_parallel_size: Annotated[int, Flag(low=1)] = 1
    """vLLM pipeline parallelism (layers split across nodes)"""
    vllm_executor: Annotated[str | None, Flag(choices="draftheads.datagen.backends:VLLM_EXECUTORS")] = None
    """vLLM's distributed executor: ray spans the nodes of a running Ray cluster (default: vLLM's choice,
    processes on this node)"""

    def target(self, target: TargetOptions):
        """(target, vLLM options): the loaded target, or for vLLM the spec (vLLM loads the weights)."""
        if self.engine != "vllm":
            return target.load(), None
        return target.target, {"python": self.vllm_python, "dtype": target.dtype,
                               "tensor_parallel_size": self.tensor_parallel_size,
                               "data_parallel_size": self.data_parallel_size,
                               "pipeline_parallel_size": self.pipeline_parallel_size,
                               "executor": self.vllm_executor}


# --------------------------------------------------------------------------------------------- builder

@dataclass
class _Param:
    name: str
    hint: Any
    default: Any  # _REQUIRED when the flag must be given
    help: str


_REQUIRED = object()


def _shape(hint) -> tuple[Any, str | None, Flag]:
    """(item type, container: None | 'list' | 'dict', Flag) of an annotation."""
    flag = Flag()
    if typing.get_origin(hint) is Annotated:
        hint, *extras = typing.get_args(hint)
        flag = next((e for e in extras if isinstance(e, Flag)), flag)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        return typing.get_args(hint)[0], "list", flag
    if origin is dict:
        return typing.get_args(hint)[1], "dict", flag
    return hint, None, flag


def _registry(spec: str) -> list[str]:
    module, name = spec.split(":")
    return list(getattr(importlib.import_module(module), name))


def _checked(kind, low, sep, choices):
    """An argparse ``type``: one value (or a ``sep`` list, as a tuple) of ``kind``, each >= ``low`` and
    among ``choices`` when given."""
    def convert(text: str):
        try:
            values = [kind(x.strip()) for x in text.split(sep) if x.strip()] if sep else [kind(text)]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'list of ' if sep else ''}{kind.__name__}"
                                             + (f" (like 1{sep}4{sep}16)" if sep and kind is int else "")) from None
        if sep and not values:
            raise argparse.ArgumentTypeError(f"{text!r}: give at least one value")
        if low is not None and any(v < low for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: {'each value ' if sep else ''}must be >= {low:g}")
        if choices is not None and set(values) - set(choices):
            raise argparse.ArgumentTypeError(f"{text!r}: use {'some' if sep else 'one'} of {', '.join(choices)}")
        return tuple(values) if sep else values[0]

    convert.__name__ = kind.__name__  # argparse names the type in its messages
    return convert


def _group_params(cls, default) -> list[_Param]:
    docs = {p.arg_name: p.description for c in reversed(cls.__mro__[:-1])
            for p in docstring_parser.parse_from_object(c).params}
    hints = typing.get_type_hints(cls, include_extras=True)
    own = cls.__dict__.get("__annotations__", {})
    out = []
    for f in sorted(dataclasses.fields(cls), key=lambda f: f.name not in own):  # a subclass's own fields first
        if default is not None:
            value = getattr(default, f.name)
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = _REQUIRED
        out.append(_Param(f.name, hints[f.name], value, " ".join((docs.get(f.name) or "").split())))
    return out


def _signature(fn: Callable):
    hints = typing.get_type_hints(fn, include_extras=True)
    docs = {p.arg_name: " ".join(p.description.split()) for p in docstring_parser.parse(fn.__doc__ or "").params}
    for p in inspect.signature(fn).parameters.values():
        default = _REQUIRED if p.default is inspect.Parameter.empty else p.default
        yield p.name, hints[p.name], default, docs.get(p.name, "")


def _is_group(hint) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _add(parser, p: _Param) -> None:
    kind, container, flag = _shape(p.hint)
    name = flag.name or "--" + p.name.replace("_", "-")
    required = p.default is _REQUIRED
    kw: dict[str, Any] = {"help": p.help}
    if container == "dict":  # one optional flag per registry key, gathered into {key: value}
        for key in _registry(flag.choices):
            parser.add_argument(f"--{key}", dest=f"{p.name}.{key}", metavar=p.name.upper().rstrip("S"), default=None,
                                help=f"{p.help} ({key})")
        return
    if kind is bool:
        if p.default is True:
            name = "--no-" + p.name.replace("_", "-")
        parser.add_argument(name, dest=p.name, action="store_false" if p.default is True else "store_true",
                            help=f"turn off: {p.help}" if p.default is True else p.help)
        return
    choices = _registry(flag.choices) if flag.choices else None
    if flag.low is not None or flag.sep:
        kw["type"] = _checked(kind, flag.low, flag.sep, choices)
        if choices and flag.sep:
            kw["metavar"] = ",".join(choices)
        elif choices:
            kw["choices"] = choices
    else:
        kw["type"], kw["choices"] = kind, choices
    if container == "list" and not flag.sep:
        kw["nargs"] = "+"
        if choices:
            kw["metavar"] = p.name.upper().rstrip("S")
            kw["help"] = f"{p.help}; some of: {', '.join(choices)}"
    if not required and p.default not in (None, [], ()):
        shown = flag.sep.join(map(str, p.default)) if flag.sep else (
            " ".join(map(str, p.default)) if container == "list" else p.default)
        kw["help"] = f"{kw['help']} (default: {shown})" if kw["help"] else f"default: {shown}"
    if flag.positional:
        parser.add_argument(p.name, metavar=p.name.upper(), **kw)
    else:
        parser.add_argument(name, dest=p.name, required=required, default=None if required else p.default, **kw)


def add_command(sub, name: str, fn: Callable) -> argparse.ArgumentParser:
    """A subparser for ``fn``: its own parameters first, then one argument group per option group."""
    doc = docstring_parser.parse(fn.__doc__ or "")
    parser = sub.add_parser(name, help=doc.short_description, description=" ".join(
        x for x in (doc.short_description, doc.long_description) if x), formatter_class=_Formatter)
    groups = []
    for pname, hint, default, help in _signature(fn):
        if hint is CommandLine:
            continue
        if _is_group(hint):
            groups.append((hint, None if default is _REQUIRED else default))
        else:
            _add(parser, _Param(pname, hint, default, help))
    for cls, default in groups:
        group = parser.add_argument_group(cls.__doc__.strip().splitlines()[0])
        for p in _group_params(cls, default):
            _add(group, p)
    parser.set_defaults(func=fn)
    return parser


def call(fn: Callable, ns: argparse.Namespace, command_line: str):
    """``fn`` called with the arguments the parser read for it."""
    return fn(**arguments(fn, ns, command_line))


def arguments(fn: Callable, ns: argparse.Namespace, command_line: str) -> dict[str, Any]:
    """``fn``'s keyword arguments from the namespace: option groups built (and so checked), registry-keyed
    flags gathered into one dict, the command line where a parameter asks for it."""
    values = vars(ns)
    kwargs = {}
    for pname, hint, _, _ in _signature(fn):
        if hint is CommandLine:
            kwargs[pname] = command_line
        elif _is_group(hint):
            kwargs[pname] = hint(**{f.name: values[f.name] for f in dataclasses.fields(hint)})
        elif _shape(hint)[1] == "dict":
            prefix = pname + "."
            kwargs[pname] = {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix) and v is not None}
        else:
            kwargs[pname] = values[pname]
    return kwargs


class _Formatter(argparse.HelpFormatter):
    def __init__(self, prog):
        super().__init__(prog, max_help_position=32)
