import dataclasses
from typing import Annotated

import pytest

from draftheads.cli import COMMANDS, build_parser, main
from draftheads.options import (
    DrafterOptions,
    EngineOptions,
    Flag,
    LoadOptions,
    SamplingOptions,
    TargetOptions,
    add_command,
    arguments,
)

GROUPS = (TargetOptions, LoadOptions, SamplingOptions, DrafterOptions, EngineOptions)


def _help(capsys, *args) -> str:
    with pytest.raises(SystemExit) as e:
        main([*args, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def _flag(name: str, default) -> str:
    return ("--no-" if default is True else "--") + name.replace("_", "-")


def _parse(*argv):
    ns = build_parser().parse_args(list(argv))
    return arguments(ns.func, ns, "draftheads " + " ".join(argv))


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_subcommand_help_lists_its_groups_flags_once(command, capsys):
    text = _help(capsys, command)
    assert text.startswith(f"usage: draftheads {command} ")
    hints = {p: h for p, h in COMMANDS[command].__annotations__.items()}
    groups = [g for g in GROUPS if g.__name__ in hints.values() or g in hints.values()]
    for group in groups:
        title = group.__doc__.strip().splitlines()[0]
        assert f"\n{title}:\n" in text, title  # the group's own section, titled by its docstring
        for f in dataclasses.fields(group):
            flag = _flag(f.name, f.default)
            assert text.count(f"\n  {flag} ") + text.count(f"\n  {flag}\n") == 1, (command, flag)
    if command not in ("import", "recipe", "report"):  # no model loads (a recipe's stages load their own)
        assert "\n  --device DEVICE " in text and "\n  --dtype DTYPE " in text


def _section(text: str, title: str) -> str:
    """One argument group of a help page, defaults removed (a subcommand may set its own)."""
    import re

    body = text.split(f"\n{title}:\n", 1)[1].split("\n\n", 1)[0]
    return re.sub(r" ?\(default: [^)]*\)", "", " ".join(body.split()))


def test_shared_groups_read_the_same_in_every_subcommand(capsys):
    """Each option group's section (flags, metavars, help) is identical wherever it appears: one definition."""
    sections: dict[str, set[str]] = {}
    users: dict[str, list[str]] = {}
    for command, fn in COMMANDS.items():
        text = _help(capsys, command)
        for group in GROUPS:
            if group.__name__ in fn.__annotations__.values() or group in fn.__annotations__.values():
                title = group.__doc__.strip().splitlines()[0]
                sections.setdefault(title, set()).add(_section(text, title))
                users.setdefault(title, []).append(command)
    assert len(users["the target model"]) == 10 and len(users["sampling (temperature 0 is greedy: token-identical "
                                                                "to plain decoding)"]) == 4
    for title, seen in sections.items():
        assert len(seen) == 1, (title, users[title], seen)


def test_groups_are_built_from_the_flags_with_per_command_defaults():
    kw = _parse("generate", "--prompt", "hi", "--tree", "chain3", "--temperature", "0.5", "--top-k", "7",
                "--device", "cpu", "--threads", "2")
    assert kw["drafter"] == DrafterOptions(tree=("chain3",))
    assert kw["sampling"] == SamplingOptions(temperature=0.5, top_k=7)
    assert kw["target"].device == "cpu" and kw["target"].threads == 2 and kw["prompt"] == "hi"
    assert _parse("synthesize", "--out", "x")["sampling"] == SamplingOptions(temperature=1.0, top_p=0.95)
    kw = _parse("eval", "--out", "x", "--head", "h")
    assert kw["drafter"].tree == ("auto", "chain3") and kw["command_line"] == "draftheads eval --out x --head h"
    assert _parse("cache-features", "--data", "a", "b", "--out", "o", "--no-pack")["pack"] is False
    kw = _parse("bench", "--out", "o", "--eagle3", "e", "--dflash", "d", "--batches", "1,8", "--only", "batch")
    assert kw["heads"] == {"eagle3": "e", "dflash": "d"} and kw["batches"] == (1, 8) and kw["only"] == ("batch",)
    kw = _parse("import", "ckpt", "--from", "eagle3", "--out", "h")
    assert kw["src"] == "ckpt" and kw["source"] == "eagle3"
    assert isinstance(_parse("export", "--head", "h", "--format", "vllm-eagle3", "--out", "o")["load"], LoadOptions)
    assert _parse("distill", "--prompts", "p", "--out", "o", "--engine", "vllm")["engine"].engine == "vllm"


@pytest.mark.parametrize("argv, expected", [
    (["profile", "--ks", "1,x"], "argument --ks: '1,x' is not a list of int"),
    (["profile", "--ks", "0,4"], "argument --ks: '0,4': each value must be >= 1"),
    (["info", "--threads", "0"], "argument --threads: '0': must be >= 1"),
    (["bench", "--out", "o", "--only", "verify,nope"], "argument --only: 'verify,nope': use some of verify"),
    (["generate", "--prompt", "x", "--tree", "small,small"], "--tree 'small,small': give one or more distinct"),
    (["generate", "--prompt", "x", "--tree", "chain3,small"], "give one mode here (eval takes a list)"),
    (["generate", "--prompt", "x", "--top-p", "0"], "top_p 0.0 must be in (0, 1]"),
    (["distill", "--prompts", "p", "--out", "o", "--engine", "sglang"], "argument --engine: invalid choice"),
    (["synthesize", "--out", "o", "--domains", "chat", "poetry"], "argument --domains: invalid choice: 'poetry'"),
    (["import", "--from", "eagle3", "--out", "h"], "the following arguments are required: SRC"),
])
def test_bad_flags_end_in_one_error_line(argv, expected, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert expected in err[0], err[0]
    assert not list(tmp_path.iterdir())


def test_builder_spells_a_typed_signature():
    import argparse

    def job(src: Annotated[str, Flag(positional=True)], source: Annotated[str, Flag(name="--from")],
            sizes: Annotated[tuple[int, ...], Flag(sep=",", low=2)] = (2, 4), names: tuple[str, ...] = ("a",),
            fast: bool = False, keep: bool = True, limit: int | None = None, sampling: SamplingOptions =
            SamplingOptions(seed=3)) -> int:
        """Do a job.

        Args:
            src: the input
            sizes: the sizes
        """
        return 0

    sub = argparse.ArgumentParser().add_subparsers()
    parser = add_command(sub, "job", job)
    ns = parser.parse_args(["in", "--from", "x", "--sizes", "2,8", "--names", "b", "c", "--fast", "--no-keep"])
    kw = arguments(job, ns, "")
    assert kw == {"src": "in", "source": "x", "sizes": (2, 8), "names": ["b", "c"], "fast": True, "keep": False,
                  "limit": None, "sampling": SamplingOptions(seed=3)}
    text = parser.format_help()
    assert "the sizes (default: 2,4)" in text and "the input" in text and "--no-keep" in text


def test_readme_lists_every_subcommand_with_its_groups():
    from pathlib import Path

    names = {TargetOptions: "target", SamplingOptions: "sampling", DrafterOptions: "drafter",
             EngineOptions: "engine", LoadOptions: "load"}
    text = (Path(__file__).parents[1] / "README.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[0].strip("`") in COMMANDS:
            rows[cells[0].strip("`")] = {g.strip() for g in cells[2].split(",")} - {"none"}
    assert set(rows) == set(COMMANDS)
    for command, fn in COMMANDS.items():
        groups = {names[h] for h in fn.__annotations__.values() if h in names} | {
            names[g] for g in names if g.__name__ in fn.__annotations__.values()}
        assert rows[command] == groups, command
