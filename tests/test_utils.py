import json
import os
import subprocess
import sys

import pytest

from draftheads.errors import DraftheadsError
from draftheads.utils import OUTPUT_MARKER, atomic_dir, exclusive, output_kind, read_jsonl_prefix


def _write(final, kind, files, **kw):
    with atomic_dir(final, kind, **kw) as tmp:
        for name, text in files.items():
            (tmp / name).write_text(text)


def test_atomic_dir_replaces_only_what_the_same_command_wrote(tmp_path):
    out = tmp_path / "out"
    _write(out, "export", {"a.json": "1"})
    assert output_kind(out) == "export" and (out / OUTPUT_MARKER).is_file()
    _write(out, "export", {"b.json": "2"})  # its own earlier output: replaced as a whole
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_MARKER, "b.json"]
    with pytest.raises(DraftheadsError, match="holds the output of `export`"):
        _write(out, "head", {"c.json": "3"})
    assert (out / "b.json").read_text() == "2"

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(DraftheadsError, match="notes.txt"):
        _write(mine, "export", {"a.json": "1"})
    assert (mine / "notes.txt").read_text() == "keep" and not (mine / "a.json").exists()
    _write(mine, "export", {"a.json": "1"}, overwrite=True)
    assert not (mine / "notes.txt").exists()


def test_unmarked_folder_holding_only_our_names_is_a_previous_output(tmp_path):
    old = tmp_path / "head"
    old.mkdir()
    (old / "config.json").write_text("{}")
    _write(old, "head", {"config.json": "{\"new\": 1}", "model.safetensors": ""})
    assert json.loads((old / "config.json").read_text()) == {"new": 1}


def test_inputs_and_files_are_refused(tmp_path):
    src = tmp_path / "head"
    src.mkdir()
    (src / "config.json").write_text("{}")
    with pytest.raises(DraftheadsError, match="is an input"):
        _write(src, "export", {"x": ""}, inputs=[src])
    with pytest.raises(DraftheadsError, match="is an input"):  # a folder holding the input
        _write(tmp_path, "export", {"x": ""}, inputs=[src], overwrite=True)
    f = tmp_path / "f.txt"
    f.write_text("x")
    with pytest.raises(DraftheadsError, match="is a file"):
        _write(f, "export", {"x": ""})
    with pytest.raises(DraftheadsError, match="not a folder"):
        _write(f / "sub", "export", {"x": ""})


def test_temporary_folders_of_killed_runs_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".out.tmp-{int(dead.stdout)}-abc"
    stale.mkdir()
    (stale / "big.bin").write_bytes(b"0" * 1024)
    live = tmp_path / f".out.tmp-{os.getpid()}-def"  # a run still going (this process): left alone
    live.mkdir()
    _write(tmp_path / "out", "export", {"a": ""})
    assert not stale.exists() and live.exists()


def test_failed_write_leaves_the_old_output(tmp_path):
    out = tmp_path / "out"
    _write(out, "export", {"a": "old"})
    with pytest.raises(RuntimeError):
        with atomic_dir(out, "export") as tmp:
            (tmp / "a").write_text("new")
            raise RuntimeError("killed")
    assert (out / "a").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_exclusive_refuses_a_second_holder_and_frees_on_exit(tmp_path):
    target = tmp_path / "d.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from draftheads.utils import exclusive\n"
        f"with exclusive({str(target)!r}):\n    print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DraftheadsError, match=f"being written by another run \\(pid {holder.pid}\\)"):
            with exclusive(target):
                pass
    finally:
        holder.kill()
        holder.wait()
    with exclusive(target):  # the kernel released the dead holder's lock
        assert (tmp_path / "d.jsonl.lock").is_file()
    assert not (tmp_path / "d.jsonl.lock").exists()


def test_jsonl_prefix_drops_only_a_torn_last_line(tmp_path, caplog):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": 1}\n{"id": 2}\n{"id": ')
    assert read_jsonl_prefix(f) == [{"id": 1}, {"id": 2}]
    assert "torn last line" in caplog.text
    f.write_text('{"id": 1}\n{"id": \n{"id": 3}\n')
    with pytest.raises(DraftheadsError, match="line 2"):
        read_jsonl_prefix(f)
