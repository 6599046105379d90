"""A data store: the text the target writes (synthesized prompts, distilled answers) kept in a directory
that outlives the run's, committed or mounted, so that a machine that loses its disk between sessions
resumes hours of generation from it (``data.store`` of a recipe)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from draftheads.recipe.runner import Run
from draftheads.utils import atomic_write_bytes, atomic_write_json, read_jsonl_prefix

STORED = {"synthesize": ("synth.jsonl", ".stats.json"), "distill": ("train.jsonl", ".settings.json")}
"""What a data store keeps per stage: the output under the run's data/ and what a finished one has beside it
(a stage still running has ``.partial`` and ``.partial.json`` instead, which resume it)."""


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
    """The text outputs of synthesize and distill kept in a directory that outlives the run's (``data.store``).

    :meth:`save` copies each one there as it grows (finished files replace the partial ones, and the partial
    ones of a growing output replace the finished ones they extend); :meth:`seed` puts
    the stored ones into a run directory that lacks them, with the wall time and machines they took."""

    def __init__(self, root: Path, data: Path, prompts: list[str]):
        self.root, self.data, self.prompts = root, data, prompts  # prompts: what the distilled records answer
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
                # extension (a grown run reopens the finished file as the partial one), holding all of it
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
                    f"{run.shown(self.root)}")

    def seeds(self, stage: str) -> Path | None:
        """The store's finished output of ``stage`` that :meth:`seed` puts into a run holding nothing of it."""
        if self.holds(self.root, stage) and self.holds(self.data, stage) is None:
            return self.root / STORED[stage][0]
        return None

    def _prompts(self) -> dict:
        from draftheads.prompts import load_prompts

        return {p.id: p for spec in self.prompts for p in load_prompts(spec)}

    def drop(self, stage: str) -> None:
        """Forget a stage that is made again (so that no later run is seeded with the old output)."""
        for f in self.files(stage, True) + self.files(stage, False):
            remove_parts(self.root / f)
