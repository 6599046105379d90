import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from draftheads.errors import DraftheadsError
from draftheads.recipe.runner import Run, Stage, check_names, claim, order_redo, owner_problem, unmet_need


def test_a_stage_saves_its_time_while_it_runs_without_output(tmp_path, monkeypatch):
    """A stage that prints nothing for a while still has its time so far saved (a killed run keeps it),
    and a rerun after the kill counts that time towards the stage."""
    monkeypatch.setattr(Run, "tick_seconds", 0.05)
    run = Run(tmp_path)
    seen = []

    def quiet():
        time.sleep(0.4)
        seen.append(json.loads(run.times_file.read_text())["running"]["quiet"])
        raise KeyboardInterrupt  # killed mid-stage

    with pytest.raises(KeyboardInterrupt):
        run.stage("quiet", tmp_path / "out", quiet)
    assert 0 < seen[0] <= 1.0, seen
    saved = json.loads(run.times_file.read_text())["running"]["quiet"]
    assert saved >= seen[0]
    again = Run(tmp_path)
    again.stage("quiet", tmp_path / "out", lambda: (tmp_path / "out").write_text("done"))
    total = json.loads(again.times_file.read_text())
    assert "quiet" not in total["running"] and saved <= total["quiet"] < saved + 2.0


def test_a_run_stopped_by_sigterm_stops_its_stages_process(tmp_path):
    """A recipe run sent SIGTERM mid-stage stops the stage's process too (a training fit left behind would
    go on using the machine), and exits with the signal's status."""
    pid_file = tmp_path / "stage.pid"
    stage = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    runner = textwrap.dedent(f"""
        from pathlib import Path
        from draftheads.recipe.runner import Run
        Run(Path({str(tmp_path / 'run')!r})).cmd("stage", [{sys.executable!r}, "-c", {stage!r}])
    """)
    parent = subprocess.Popen([sys.executable, "-c", runner])
    deadline = time.time() + 60
    while not (pid_file.is_file() and pid_file.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    child = int(pid_file.read_text())
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(30) == 128 + signal.SIGTERM
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(child, 0)


def test_a_finished_stage_is_reused_and_logged_by_its_output(tmp_path):
    run = Run(tmp_path)
    out = tmp_path / "data/synth.jsonl"
    run.stage("synthesize", out, lambda: (out.parent.mkdir(), out.write_text("{}\n")))
    again = Run(tmp_path)
    again.stage("synthesize", out, lambda: (_ for _ in ()).throw(AssertionError("made again")))
    assert f"=== synthesize: reusing {out} " in (tmp_path / "log.txt").read_text()
    # an output to be grown runs again, and its first making's time counts
    grown = []
    again.times["synthesize"] = 5.0
    again.stage("synthesize", out, lambda: grown.append(1), finished=False)
    assert grown == [1] and "growing its output; 5 s of earlier runs count" in (tmp_path / "log.txt").read_text()
    assert again.times["synthesize"] >= 5.0


def test_only_runs_the_named_stages_and_leaves_the_others(tmp_path):
    run = Run(tmp_path)
    only = frozenset({"scaling"})
    run.stage("extend", tmp_path / "extended2/head", lambda: (_ for _ in ()).throw(AssertionError("ran")), only=only)
    made = tmp_path / "scaling/scaling.json"
    run.stage("scaling", made, lambda: (made.parent.mkdir(), made.write_text("[]")), only=only)
    assert made.is_file()
    assert "=== extend: not run (not in --only)" in (tmp_path / "log.txt").read_text()


def test_a_stage_in_only_counts_as_made_for_the_stages_after_it(tmp_path):
    stages = [Stage("features", tmp_path / "f"), Stage("train", tmp_path / "t", needs=("features",)),
              Stage("extend", tmp_path / "e", needs=("train",)), Stage("eval", tmp_path / "v", needs=("extend",))]
    assert unmet_need(stages, frozenset({"extend", "eval"}), lambda n: False) == ("extend", "train")
    assert unmet_need(stages, frozenset({"train", "extend", "eval"}), lambda n: n == "features") is None
    assert unmet_need(stages, frozenset({"eval"}), lambda n: n == "extend") is None


def test_a_redone_stage_redoes_the_ones_after_it_and_unknown_names_are_refused():
    names = ["distill", "features", "train", "eval"]
    assert order_redo(names, {"features"}) == {"features", "train", "eval"}
    assert order_redo(names, set()) == set()
    with pytest.raises(DraftheadsError, match="--only nope: no such stage; use some of distill,features,train,eval"):
        check_names(names, {"train", "nope"}, "--only")


def test_a_run_directory_of_another_recipe_is_refused(tmp_path):
    root = tmp_path / "run"
    claim(root, {"recipe": "a", "target": "t"})
    claim(root, {"recipe": "a", "target": "t"})  # its own: fine
    with pytest.raises(DraftheadsError, match="made by recipe 'a' for target 't', not 'b'"):
        claim(root, {"recipe": "b", "target": "t"})
    with pytest.raises(DraftheadsError, match="not 'a' for 'u'"):
        claim(root, {"recipe": "a", "target": "u"})
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert "holds files no recipe claims" in owner_problem(other, {"recipe": "a", "target": "t"})
    assert owner_problem(tmp_path / "new", {"recipe": "a", "target": "t"}) == ""
