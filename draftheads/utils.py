"""Small helpers shared across the package: atomic writes, cache directory, file hashing."""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from draftheads.errors import DraftheadsError

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/draftheads`` (default ``~/.cache/draftheads``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "draftheads"


def shown_from(path: str | os.PathLike, root: Path) -> Path:
    """``path`` relative to ``root`` when it lies inside it (a path outside stays as it is)."""
    full = Path(path).resolve()
    return full.relative_to(root) if full.is_relative_to(root) else Path(path)


def stable_int(text: str) -> int:
    """A 32-bit integer from ``text`` that is the same in every process and on every machine."""
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:4], "little")


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


OUTPUT_MARKER = ".draftheads-output.json"
"""Written into every folder a command produces: which command wrote it, so a rerun may replace it."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def output_kind(folder: str | os.PathLike) -> str | None:
    """The command that wrote ``folder`` (its marker), or None."""
    try:
        return json.loads((Path(folder) / OUTPUT_MARKER).read_text())["kind"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_writable_dir(folder: str | os.PathLike, flag: str = "--out") -> Path:
    """A folder that exists or can be created, and can be written: checked before the work starts."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise DraftheadsError(f"{flag} {folder} is a file: give a folder path")
    parent = folder.resolve()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise DraftheadsError(f"{flag} {folder}: {parent} is not a folder, so nothing can be written under it")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DraftheadsError(f"{flag} {folder}: {parent} is not writable: choose another folder")
    return folder


def check_writable_file(path: str | os.PathLike, flag: str = "--out") -> Path:
    """A file path whose folder exists or can be created, and can be written."""
    path = Path(path)
    if path.is_dir():
        raise DraftheadsError(f"{flag} {path} is a folder: give a file path")
    check_writable_dir(path.parent, flag)
    return path


def check_output_dir(final: str | os.PathLike, kind: str, *, overwrite: bool = False, inputs=(),
                     names=None, flag: str = "--out", fix: str = "pass --overwrite to replace it") -> Path:
    """Refuse an output folder whose replacement would destroy what ``kind`` did not write.

    Allowed: a new folder, an empty one, a previous output of ``kind`` (its marker), and an unmarked
    folder holding only ``names`` (the files the output holds, glob patterns allowed; None = not known
    yet, so that rule waits for a later check). Refused: a file,
    an input of the command (or a folder holding one), another command's output, foreign files, and a place
    that cannot be written. ``overwrite`` lifts the foreign-files rule only."""
    final = Path(final)
    here = final.resolve()
    for src in inputs:
        src = Path(src).resolve()
        if here == src or here in src.parents:
            raise DraftheadsError(f"{flag} {final} is an input of this command ({src}): write to another folder")
    check_writable_dir(final, flag)
    if overwrite or not final.is_dir() or not any(final.iterdir()):
        return final
    wrote = output_kind(final)
    if wrote == kind:
        return final
    if wrote is not None:
        raise DraftheadsError(f"{flag} {final} holds the output of `{wrote}`, not of `{kind}`: choose another folder, "
                              f"or {fix}")
    if names is None:  # not known yet: checked again when the output is complete
        return final
    foreign = sorted(p.name for p in final.iterdir()
                     if p.name != OUTPUT_MARKER and not any(fnmatch.fnmatchcase(p.name, n) for n in names))
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise DraftheadsError(f"{flag} {final} already holds files this command did not write ({shown}): choose "
                              f"another folder, or {fix}")
    return final


def clean_stale_temps(final: str | os.PathLike) -> list[Path]:
    """Remove the temporary folders that killed runs left beside ``final`` (their process is gone)."""
    final = Path(final)
    removed = []
    if not final.parent.is_dir():
        return removed
    for p in final.parent.glob(f".{final.name}.tmp-*-*"):
        pid = p.name[len(final.name) + 6:].split("-", 1)[0]
        if p.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    if removed:
        log.warning("removed %d temporary folder(s) left by a killed run beside %s", len(removed), final)
    return removed


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, kind: str, *, overwrite: bool = False, inputs=(),
               flag: str = "--out") -> Iterator[Path]:
    """Yield a temporary directory next to ``final``; on success it replaces ``final`` in one rename.

    ``final`` may be replaced only as :func:`check_output_dir` allows (checked before and, with the
    names just written, again at the end); the new folder carries ``kind``'s marker. Temporary folders
    of killed runs beside it are removed first."""
    final = Path(final)
    check_output_dir(final, kind, overwrite=overwrite, inputs=inputs, flag=flag)
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))
    try:
        yield tmp
        publish_dir(tmp, final, kind, overwrite=overwrite, inputs=inputs, flag=flag)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish_dir(done: Path, final: Path, kind: str, *, overwrite: bool = False, inputs=(), flag: str = "--out") -> None:
    """Mark the finished folder ``done`` as ``kind``'s output and put it in place of ``final`` in one rename
    (a previous ``final`` is replaced only as :func:`check_output_dir` allows, given the names ``done`` holds)."""
    (done / OUTPUT_MARKER).write_text(json.dumps({"kind": kind}) + "\n")
    if final.exists():
        check_output_dir(final, kind, overwrite=overwrite, inputs=inputs, flag=flag,
                         names=[p.name for p in done.iterdir()])
        old = final.with_name(f".{final.name}.tmp-{os.getpid()}-old")
        os.replace(final, old)
        os.replace(done, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(done, final)


@contextlib.contextmanager
def exclusive(path: str | os.PathLike, flag: str = "--out") -> Iterator[None]:
    """Hold ``path.lock`` for the duration: a second run writing the same output stops with one line.
    The lock is the kernel's (``flock``), so a killed run never leaves it held."""
    import fcntl

    lock = Path(f"{path}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        f = lock.open("a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise DraftheadsError(f"{flag} {path} is being written by another run ({holder}): wait for it to "
                                  "finish, or write to another path") from None
        try:  # the holder before us may have removed the file after we opened it: lock the current one
            if os.stat(lock).st_ino == os.fstat(f.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()
    try:
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}")
        f.flush()
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
        f.close()


def read_utf8(path: str | os.PathLike, what: str) -> str:
    """The text of a user's file, or one error naming it (``what``: e.g. "prompts file") when it is not UTF-8."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DraftheadsError(f"{what} {str(path)!r} is not UTF-8 text (byte {e.start}): save it as UTF-8 "
                              "jsonl") from None


def read_jsonl_prefix(path: str | os.PathLike) -> list[dict]:
    """The records of a jsonl file being appended to. A torn last line (a crash mid-write) is dropped
    with a warning; a bad line before the last means the file was damaged otherwise, and is refused."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = path.read_bytes().split(b"\n")
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError):
            if any(rest.strip() for rest in lines[n:]):
                raise DraftheadsError(f"{path} line {n} is not a JSON record: the file was damaged; delete it to "
                                      "start over") from None
            log.warning("%s: dropped a torn last line (the run before was killed while writing it)", path)
    return out


def partial_paths(out: Path) -> tuple[Path, Path]:
    """Where a resumable run writing ``out`` keeps its progress (``OUT.partial``) and settings
    (``OUT.partial.json``) until ``out`` is finished."""
    return out.with_name(out.name + ".partial"), out.with_name(out.name + ".partial.json")


def refuse_changed_settings(old: dict, new: dict, partial: str | os.PathLike, action: str = "resume") -> None:
    """A resume (or an ``--extend``, ``action="extend"``) must use the settings the file was started with."""
    if old != new:
        diff = sorted(k for k in new.keys() | old.keys() if old.get(k) != new.get(k))
        raise DraftheadsError(
            f"{partial} was {'started' if action == 'resume' else 'written'} with other settings "
            f"({', '.join(diff)}): rerun with the same settings to {action} it, or "
            + ("delete it to start over" if action == "resume" else "write a new --out")
        )


def _unreadable(file, e: Exception) -> DraftheadsError:
    return DraftheadsError(f"{file} is not a readable safetensors file ({' '.join(str(e).split())}): it is truncated "
                           "or damaged; write it again")


def safetensors_shapes(file: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from a safetensors header (nothing loaded), or one error naming the file."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error type for every kind of damage
        raise _unreadable(file, e) from None


def load_safetensors(file: str | os.PathLike) -> dict:
    """All tensors of a safetensors file (on the CPU), or one error naming the file."""
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except Exception as e:
        raise _unreadable(file, e) from None


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj, indent: int = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=False) + "\n")
