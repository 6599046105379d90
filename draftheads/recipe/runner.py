"""The one stage runner: skip what is finished, resume what is not, ``--redo`` and ``--only``, a dry run.

A run directory holds everything a recipe makes, its log (``log.txt``), each stage's wall time over
every run of it beside the batch-1 decode rate of each machine it ran on (``stages.json``), and the
recipe that owns it (``recipe.json``): a directory made by another recipe is refused, never mixed.
The runner's state is what lies in the directory, so a stage can run on another machine (``--only``)
with the directory on shared storage.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from draftheads.errors import DraftheadsError
from draftheads.utils import atomic_write_json


@dataclass
class Step:
    """One command of a stage. ``prepare`` writes what the command reads (a training config) just before
    it runs, never in a dry run; ``done``: the step's own output, which lets a resumed stage skip it."""

    label: str
    argv: list[str]
    prepare: Callable[[], None] | None = None
    done: Path | None = None


@dataclass
class Stage:
    """A stage: finished once ``done`` exists (or ``check`` says so, for an output that grows or is made of
    several), made by ``before``, its ``steps``, then ``after`` (in-process work: tables, packaging; called
    with the run's stage times and its ``say``). ``needs``: the stages whose outputs it reads; ``also``:
    what else it writes (removed by ``--redo``); ``grown``: part of its output was made before."""

    name: str
    done: Path
    steps: list[Step] = field(default_factory=list)
    after: Callable[[dict, Callable[[str], None]], None] | None = None
    before: Callable[[], None] | None = None
    describe: str = ""
    needs: tuple[str, ...] = ()
    also: list[Path] = field(default_factory=list)
    check: Callable[[], bool] | None = None
    grown: bool = False
    skip: str = ""
    """why the stage does not run here (e.g. vLLM is not installed); it is then reported, never passed"""

    def finished(self) -> bool:
        return self.done.exists() if self.check is None else self.check()


def _terminated(signum, frame):
    raise SystemExit(128 + signum)


def _stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """Ask a stage's process to stop (a fit saves what it can on SIGTERM), and kill it after ``grace``
    seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Run:
    """A run directory: its log, its stage times and the stages' subprocesses."""

    tick_seconds = 30.0
    """How often a running stage's wall time so far is saved (a killed run loses at most this much of it)."""

    def __init__(self, root: Path, cwd: Path | None = None, shown: Callable[[Path], Path] = lambda p: p):
        self.root, self.cwd, self.shown = root, cwd, shown
        root.mkdir(parents=True, exist_ok=True)
        self.log = (root / "log.txt").open("a", encoding="utf-8")
        self.times_file = root / "stages.json"
        self.times = json.loads(self.times_file.read_text()) if self.times_file.is_file() else {}
        self._stage, self._prior, self._t0 = None, 0.0, 0.0
        self._lock = threading.Lock()  # the ticker thread and the main thread both save the times
        self.on_tick: list[Callable[[], None]] = []
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

    def cmd(self, label: str, argv: list[str]) -> None:
        """Run ``argv``, its output to the terminal and the log (progress bars left out of the log)."""
        self.say(f"=== {label}: {' '.join(argv)}")
        proc = subprocess.Popen(argv, cwd=self.cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _terminated) if main else None
        try:
            for line in proc.stdout:
                if "it/s]" in line or "s/it]" in line:
                    continue
                sys.stdout.write(line)
                self.log.write(line)
                self.log.flush()
            proc.wait()
        except BaseException:  # stopped (Ctrl-C, or SIGTERM): the stage's process stops with the run
            _stop(proc)
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        if proc.returncode != 0:
            self.say(f"stage {label} failed (exit {proc.returncode}); fix the error above and rerun: finished "
                     "stages are kept and this one resumes")
            raise SystemExit(1)

    def forget(self, name: str) -> None:
        """Drop the recorded time of a stage that is made again."""
        self.times.pop(name, None)
        self.times.get("running", {}).pop(name, None)
        self.times.get("machines", {}).pop(name, None)
        self.save_times()

    def stage(self, name: str, done: Path, fn: Callable[[], None], finished: bool | None = None, grown: bool = False,
              only: frozenset[str] = frozenset()) -> None:
        """Run ``fn`` unless the stage is ``finished`` (default: ``done`` exists), or ``only`` leaves it out;
        ``grown``: part of the stage's output was made before (its recorded time counts)."""
        if done.exists() if finished is None else finished:
            self.say(f"=== {name}: reusing {self.shown(done)} (--redo {name} to run it again)")
            return
        if only and name not in only:
            self.say(f"=== {name}: not run (not in --only)")
            return
        grown = grown or done.exists()  # the first making of an output that is now grown counts
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


def order_redo(names: list[str], redo: set[str]) -> set[str]:
    """``redo`` with every stage after its first one: a redone stage invalidates the ones that follow."""
    first = min((names.index(s) for s in redo), default=len(names))
    return redo | set(names[first:])


def unmet_need(stages: list[Stage], only: frozenset[str], ready: Callable[[str], bool]) -> tuple[str, str] | None:
    """The first (stage of ``only``, stage it reads) where the stage read is neither in ``only`` nor ``ready``."""
    for s in stages:
        if s.name in only:
            for n in s.needs:
                if n not in only and not ready(n):
                    return s.name, n
    return None


def check_names(names: list[str], given: set[str], flag: str) -> None:
    unknown = given - set(names)
    if unknown:
        raise DraftheadsError(f"{flag} {','.join(sorted(unknown))}: no such stage; use some of {','.join(names)}")


def owner_problem(root: Path, owner: dict) -> str:
    """Why ``root`` cannot hold a run of the recipe ``owner`` ({"recipe": name, "target": spec}): another
    recipe made it, or it holds files no recipe claims ("" when it can)."""
    mark = root / "recipe.json"
    if mark.is_file():
        held = json.loads(mark.read_text())
        if {k: held.get(k) for k in owner} != owner:
            return (f"run directory {root} was made by recipe {held.get('recipe')!r} for target "
                    f"{held.get('target')!r}, not {owner['recipe']!r} for {owner['target']!r}: give another "
                    "run_dir (--set run_dir=...)")
        return ""
    if root.is_dir() and any(root.iterdir()):
        return f"run directory {root} holds files no recipe claims: give another run_dir (--set run_dir=...) or empty it"
    return ""


def claim(root: Path, owner: dict) -> None:
    """Mark ``root`` as the run directory of the recipe ``owner``, refusing one another recipe made."""
    if problem := owner_problem(root, owner):
        raise DraftheadsError(problem)
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "recipe.json").is_file():
        atomic_write_json(root / "recipe.json", owner)
