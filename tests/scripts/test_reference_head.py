import json
from argparse import Namespace
from pathlib import Path

import pytest
from _scripts import load_script


def _script():
    return load_script("reference_head")


def _point(tokens, acc, window=None, epochs=2):
    p = {"answer_tokens": tokens, "epochs": epochs, "val_acc": acc, "val_sim_tau": 1.5, "tau_chain3": 1.4, "speedup_chain3": 0.9}
    if window:
        p.update(val_window=128, val_window_acc=window, val_window_sim_tau=1.3)
    return p


def test_scaling_table_shows_first_tokens_accuracy_where_a_head_has_it():
    args = Namespace(scaling_eval_per_domain=3, eval_tokens=128)
    table = _script().scaling_table([_point(1000, [0.5, 0.4], [0.42, 0.3], epochs=16), _point(8000, [0.6, 0.5])], args)
    lines = table.splitlines()
    assert "first 128" in lines[0] and "val acc@1 (first 128)" in lines[2]
    cols = {len(line.split("|")) for line in lines[2:]}
    assert len(cols) == 1  # header, rule and rows line up
    assert "| 1,000 | 16 | 0.500 | 0.400 | 1.50 | 0.420 | 1.30 | 1.40 | 0.90x |" in table
    assert "| 8,000 | 2 | 0.600 | 0.500 | 1.50 | – | – | 1.40 | 0.90x |" in table
    plain = _script().scaling_table([_point(8000, [0.6, 0.5])], args)
    assert "first" not in plain


def test_a_scaling_point_trains_as_many_steps_as_the_full_set():
    args = Namespace(epochs=2)
    mod = _script()
    for fraction, epochs, every in [(0.5, 4, 1), (0.25, 8, 2), (0.125, 16, 4)]:
        s = mod.scaling_schedule(args, fraction)
        assert s["max_epochs"] * fraction == 2  # epochs x data = the full set's 2 epochs
        assert (s["max_epochs"], s["check_val_every_n_epoch"], s["val_check_interval"]) == (epochs, every, 1.0)
        assert s["max_epochs"] // s["check_val_every_n_epoch"] == 4  # validated 4 times, as the full set


def test_extension_rounds_follow_on_from_each_other(tmp_path):
    import pytest
    import yaml

    mod = _script()
    assert mod.extend_rounds("2,4") == [2, 4] and mod.extend_rounds("2") == [2] and mod.extend_rounds("0") == []
    with pytest.raises(SystemExit, match="each >= 1"):
        mod.extend_rounds("2,0")
    assert [mod.round_dir(i) for i in range(3)] == ["extended", "extended2", "extended3"]
    for name, epochs in [("extended", 2), ("extended3", 4), ("extended.old", 1)]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.yaml").write_text(yaml.safe_dump({"trainer": {"max_epochs": epochs}}))
    # round 3 does not follow on without a round 2, and a copy set aside is no round
    assert mod.made_rounds(tmp_path) == [tmp_path / "extended"]
    assert mod.trained_epochs(tmp_path / "extended") == 2 and mod.trained_epochs(tmp_path / "none") is None


def test_a_stage_saves_its_time_while_it_runs_without_output(tmp_path, monkeypatch):
    """A stage that prints nothing for a while still has its time so far saved (a killed run keeps it),
    and a rerun after the kill counts that time towards the stage."""
    import json
    import time

    mod = _script()
    monkeypatch.setattr(mod.Run, "tick_seconds", 0.05)
    run = mod.Run(tmp_path)
    seen = []

    def quiet():
        time.sleep(0.4)
        seen.append(json.loads(run.times_file.read_text())["running"]["quiet"])
        raise KeyboardInterrupt  # killed mid-stage

    try:
        run.stage("quiet", tmp_path / "out", quiet)
    except KeyboardInterrupt:
        pass
    assert 0 < seen[0] <= 1.0, seen
    saved = json.loads(run.times_file.read_text())["running"]["quiet"]
    assert saved >= seen[0]
    again = mod.Run(tmp_path)
    again.stage("quiet", tmp_path / "out", lambda: (tmp_path / "out").write_text("done"))
    total = json.loads(again.times_file.read_text())
    assert "quiet" not in total["running"] and saved <= total["quiet"] < saved + 2.0


def test_a_run_outside_the_checkout_reuses_its_finished_stages(tmp_path):
    """tmp_path lies outside the checkout (a run directory that survives a fresh clone): a rerun skips a
    finished stage and logs its output's full path."""
    mod = _script()
    assert not tmp_path.is_relative_to(mod.ROOT)
    run = mod.Run(tmp_path)
    out = tmp_path / "data/synth.jsonl"
    run.stage("synthesize", out, lambda: (out.parent.mkdir(), out.write_text("{}\n")))
    again = mod.Run(tmp_path)
    again.stage("synthesize", out, lambda: (_ for _ in ()).throw(AssertionError("made again")))
    assert f"=== synthesize: reusing {out} " in (tmp_path / "log.txt").read_text()
    assert mod.shown(mod.ROOT / "runs/reference") == Path("runs/reference")


def test_a_data_store_keeps_the_text_as_it_grows_and_seeds_a_fresh_run(tmp_path):
    """A run saves its synthesized prompts to the store while they are partial, then finished (the partial
    files go); a fresh run directory starts from the store with the stage's time so far, and a redone
    stage is dropped from it."""
    import json

    mod = _script()
    a = mod.Run(tmp_path / "a")
    a.times.update(plain_tok_s=13.3, running={"synthesize": 100.0}, machines={"synthesize": [13.3]})
    store = mod.DataStore(tmp_path / "store", tmp_path / "a/data")
    data = tmp_path / "a/data"
    data.mkdir()
    (data / "synth.jsonl.partial.json").write_text('{"round": 1, "kept": 1}')
    (data / "synth.jsonl.partial").write_text('{"id": "syn-chat-000001"}\n')
    (data / "train.jsonl.partial").write_text("{}\n")  # no settings beside it: not a resumable distill yet
    store.save(a.times)
    assert sorted(p.name for p in store.root.iterdir()) == ["stages.json", "synth.jsonl.partial",
                                                            "synth.jsonl.partial.json"]
    assert json.loads((store.root / "stages.json").read_text()) == {
        "synthesize": {"finished": False, "machines": [13.3], "seconds": 100.0}}

    b = mod.Run(tmp_path / "b")
    b.times["plain_tok_s"] = 29.3
    mod.DataStore(store.root, tmp_path / "b/data").seed(b)
    assert (tmp_path / "b/data/synth.jsonl.partial").read_text() == '{"id": "syn-chat-000001"}\n'
    assert b.times["running"] == {"synthesize": 100.0}
    b.stage("synthesize", tmp_path / "b/data/synth.jsonl", lambda: None)
    assert b.times["synthesize"] >= 100.0 and b.times["machines"]["synthesize"] == [13.3, 29.3]

    (data / "synth.jsonl.partial").rename(data / "synth.jsonl")
    (data / "synth.jsonl.partial.json").rename(data / "synth.jsonl.stats.json")
    a.times["synthesize"] = a.times.pop("running")["synthesize"]
    (data / "synth.jsonl").write_text('{"id": "syn-chat-000001"}\n{"id": "syn-code-000001"}\n')
    store.save(a.times)
    assert sorted(p.name for p in store.root.iterdir()) == ["stages.json", "synth.jsonl", "synth.jsonl.stats.json"]
    c = mod.Run(tmp_path / "c")
    mod.DataStore(store.root, tmp_path / "c/data").seed(c)
    assert (tmp_path / "c/data/synth.jsonl").read_text().count("\n") == 2 and c.times["synthesize"] == 100.0
    assert "taken from the data store" in (tmp_path / "c/log.txt").read_text()

    # growing it (synthesize --extend reopens the finished file as the partial one): the store keeps the partial
    # files, and a fresh run resumes the growth instead of starting it over from the smaller finished file
    (data / "synth.jsonl").rename(data / "synth.jsonl.partial")
    (data / "synth.jsonl.partial.json").write_text('{"round": 2, "kept": 3}')
    with (data / "synth.jsonl.partial").open("a") as f:
        f.write('{"id": "syn-math-000001"}\n')
    store.save(a.times)
    assert sorted(p.name for p in store.root.iterdir()) == ["stages.json", "synth.jsonl.partial",
                                                            "synth.jsonl.partial.json"]
    d = mod.Run(tmp_path / "d")
    mod.DataStore(store.root, tmp_path / "d/data").seed(d)
    assert (tmp_path / "d/data/synth.jsonl.partial").read_text().count("\n") == 3
    assert not (tmp_path / "d/data/synth.jsonl").exists()
    store.drop("synthesize")
    assert sorted(p.name for p in store.root.iterdir()) == ["stages.json"]


def test_more_prompts_than_the_store_holds_grow_a_fresh_run(tmp_path):
    """A fresh run directory (a fresh clone) seeded from a store of finished prompts grows them when asked for
    more, as a run holding them itself does; a run with partial prompts of its own resumes them instead."""
    mod = _script()
    store = tmp_path / "store"
    store.mkdir()
    (store / "synth.jsonl").write_text('{"id": "syn-chat-000001"}\n{"id": "syn-code-000001"}\n')
    (store / "synth.jsonl.stats.json").write_text('{"total": 2}')
    fresh = tmp_path / "fresh/data"
    seeded = mod.DataStore(store, fresh)
    assert seeded.seeds("synthesize") == store / "synth.jsonl" and seeded.seeds("distill") is None
    assert mod.grows(fresh / "synth.jsonl", seeded, 4) and not mod.grows(fresh / "synth.jsonl", seeded, 2)
    assert not mod.grows(fresh / "synth.jsonl", None, 4)  # no store, no prompts: synthesize writes all 4
    own = tmp_path / "own/data"
    own.mkdir(parents=True)
    (own / "synth.jsonl").write_text('{"id": "syn-chat-000001"}\n')
    (own / "synth.jsonl.stats.json").write_text('{"total": 1}')
    assert mod.grows(own / "synth.jsonl", mod.DataStore(store, own), 2)  # its own 1, not the store's 2
    partial = tmp_path / "partial/data"
    partial.mkdir(parents=True)
    (partial / "synth.jsonl.partial").write_text("")
    (partial / "synth.jsonl.partial.json").write_text("{}")
    assert mod.DataStore(store, partial).seeds("synthesize") is None
    assert not mod.grows(partial / "synth.jsonl", mod.DataStore(store, partial), 4)


def test_a_head_trained_on_from_the_shipped_one_lists_every_run_and_waits_for_its_bench(tmp_path):
    """--init-head: the card's lineage is the init head's, then this run's epochs (first fit + rounds);
    the card written by package, before bench, says the bench is still to come."""
    import json

    mod = _script()
    (tmp_path / "main").mkdir()
    (tmp_path / "main/init-card.json").write_text(json.dumps(
        {"date": "2026-12-03", "command": "python scripts/reference_head.py --epochs 1", "lineage": [
            {"date": "2026-12-03", "command": "python scripts/reference_head.py --epochs 1", "epochs": 1}]}))
    runs = mod.lineage(tmp_path, Namespace(epochs=2, extend_epochs="1,3"))
    assert [r["epochs"] for r in runs] == [1, 6] and runs[0]["date"] == "2026-12-03"
    card = {"command": "c", "date": "d", "machine_plain_tok_s": 29.3, "stage_seconds": {"train": 600.0},
            "stage_machines_plain_tok_s": {"train": [29.3]},
            "data": {"train": {"conversations": 3, "answer_tokens": 30, "tokens": 40}},
            "val": {"accuracies": [0.5], "sim_tau": 1.5, "draft_vocab_coverage": None, "draft_vocab_size": 8},
            "lineage": runs, "bench": None}
    md = mod.card_markdown(card, "| eval |", "", "")
    assert "Trained over 2 runs" in md and "(7 epochs in all)" in md and "Not measured yet" in md
    assert "machines at" not in md  # one machine, the card's own
    card["bench"] = {"dtype": "bfloat16"}
    card["stage_machines_plain_tok_s"] = {"train": [13.3, 29.3]}
    md = mod.card_markdown(card, "| eval |", "| bench |", "")
    assert "| bench |" in md and "Not measured" not in md and "train 10.0 min (machines at 13.3 + 29.3 tok/s)" in md


def test_the_store_keeps_distilled_records_without_the_turns_their_prompts_hold(tmp_path):
    """Turns are left out of the stored answers and put back, byte for byte, when a run is seeded; a line
    still being written is left out."""
    import json

    from draftheads.prompts import load_prompts

    mod = _script()
    bundled = load_prompts("bundled:train")[0]
    data = tmp_path / "a/data"
    data.mkdir(parents=True)
    (data / "synth.jsonl").write_text(json.dumps({"id": "syn-qa-000001", "domain": "qa", "turns": ["Why?", "And?"]}) + "\n")
    (data / "synth.jsonl.stats.json").write_text("{}")
    records = [{"id": bundled.id, "domain": bundled.domain, "turns": [bundled.turns[0]], "answers": ["A."],
                "truncated": False},
               {"id": "syn-qa-000001", "domain": "qa", "turns": ["Why?"], "answers": ["Because"], "truncated": True}]
    text = "".join(json.dumps(r) + "\n" for r in records)
    (data / "train.jsonl.partial.json").write_text("{}")
    (data / "train.jsonl.partial").write_text(text + '{"id": "syn-')
    store = mod.DataStore(tmp_path / "store", data)
    store.save({})
    stored = (store.root / "train.jsonl.partial").read_text()
    assert "turns" not in stored and stored.count("\n") == 2
    run = mod.Run(tmp_path / "b")
    mod.DataStore(store.root, tmp_path / "b/data").seed(run)
    assert (tmp_path / "b/data/train.jsonl.partial").read_text() == text


def test_the_store_keeps_a_large_file_in_parts_cut_at_line_ends(tmp_path, monkeypatch):
    mod = _script()
    monkeypatch.setattr(mod, "PART_BYTES", 100)
    data = tmp_path / "a/data"
    data.mkdir(parents=True)
    lines = [f'{{"id": "syn-{i:03d}", "domain": "qa", "turns": ["{"why " * (i % 5)}?"]}}\n' for i in range(12)]
    (data / "synth.jsonl.partial.json").write_text("{}")
    (data / "synth.jsonl.partial").write_text("".join(lines[:6]))
    store = mod.DataStore(tmp_path / "store", data)
    store.save({})
    (data / "synth.jsonl.partial").rename(data / "synth.jsonl")  # finished, grown
    (data / "synth.jsonl.partial.json").rename(data / "synth.jsonl.stats.json")
    (data / "synth.jsonl").write_text("".join(lines))
    store.save({})
    names = sorted(p.name for p in store.root.iterdir())
    parts = [store.root / n for n in names if n.startswith("synth.jsonl.part")]
    assert len(parts) > 2 and "synth.jsonl" not in names and not any("partial" in n for n in names)
    assert all(len(p.read_bytes()) <= 100 and p.read_text().endswith("\n") for p in parts)
    assert mod.DataStore(store.root, tmp_path / "b/data").holds(store.root, "synthesize") is True
    mod.DataStore(store.root, tmp_path / "b/data").seed(mod.Run(tmp_path / "b"))
    assert (tmp_path / "b/data/synth.jsonl").read_text() == "".join(lines)
    monkeypatch.setattr(mod, "PART_BYTES", 1 << 20)  # small again: one file, no parts left
    store.save({})
    assert (store.root / "synth.jsonl").read_text() == "".join(lines)
    assert not list(store.root.glob("synth.jsonl.part*"))
    store.drop("synthesize")
    assert not list(store.root.glob("synth.jsonl*"))


def test_the_card_counts_the_conversations_packed_in_every_row_of_every_shard(tmp_path):
    import json

    import torch
    from safetensors.torch import save_file

    # shard 0: rows holding 3, 1 and 2 conversations (then padding, doc id -1); shard 1: 2 rows, 2 + 0
    docs = {"train-00000.safetensors": [[0, 0, 1, 2], [0, 0, 0, 0], [0, 1, 1, -1]],
            "train-00001.safetensors": [[0, 0, 1, 1], [-1, -1, -1, -1]],
            "val-00000.safetensors": [[0, 1, 2, 3]]}
    index = {"version": 2, "target": "t", "layer_ids": [1], "dtype": "bfloat16", "complete": True,
             "splits": {"train": [], "val": []}}
    for name, rows in docs.items():
        d = torch.tensor(rows)
        save_file({"input_ids": torch.zeros_like(d), "doc_ids": d, "loss_mask": (d >= 0).long(),
                   "feat_1": torch.zeros(*d.shape, 2)}, str(tmp_path / name))
        index["splits"][name.split("-")[0]].append({"file": name, "rows": len(rows)})
    (tmp_path / "index.json").write_text(json.dumps(index))
    counts = _script().feature_tokens(tmp_path)
    assert counts["train"] == {"answer_tokens": 15, "tokens": 15, "conversations": 8}
    assert counts["val"] == {"answer_tokens": 4, "tokens": 4, "conversations": 4}


def test_the_block_drafters_train_as_many_epochs_as_the_eagle3_head(tmp_path, monkeypatch):
    mod = _script()
    made = {}

    def fit(run, stage, config):
        made[stage] = mod.trained_epochs(config.parent)
        (config.parent / "head").mkdir()

    class Stop(Exception):
        pass

    def cmd(stage, argv):
        commands[stage] = argv
        if stage == "blocks bench":
            raise Stop  # the table it reads is not made here

    commands = {}

    monkeypatch.setattr(mod, "fit", fit)
    run = Namespace(cmd=cmd)
    args = Namespace(epochs=1, extend_epochs="3", precision="32", intermediate_size=None, eval_per_domain=1, eval_tokens=8, dtype="float32")
    import pytest

    with pytest.raises(Stop):
        mod._blocks(run, tmp_path, tmp_path / "extended/head", args)
    assert made == {"blocks dflash": 4, "blocks dspark": 4}  # 1 epoch of the first fit + a round of 3
    mode = lambda argv: argv[argv.index("--tree") + 1]  # noqa: E731
    assert {mode(commands[f"blocks eval {f}"]) for f in ("eagle3", "dflash", "dspark")} == {"chain3,chain7,small"}
    assert mode(commands["blocks bench"]) == "auto,chain7,small"  # and chain3, which the bench always runs


def test_a_card_names_paths_inside_the_checkout_from_the_checkout(tmp_path):
    import json

    mod = _script()
    run = mod.ROOT / "runs/reference"
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval/results.md").write_text(f"`draftheads eval --head {run}/extended/head`\n")
    card = {"command": "c", "date": "d", "machine_plain_tok_s": 29.3, "stage_seconds": {}, "stage_machines_plain_tok_s": {},
            "data": {"train": {"conversations": 3, "answer_tokens": 30, "tokens": 40}},
            "val": {"accuracies": [0.5], "sim_tau": 1.5, "draft_vocab_coverage": None, "draft_vocab_size": 8},
            "eval_command": f"draftheads eval --head {run}/extended/head", "lineage": [], "bench": None}
    out = tmp_path / "card"
    out.mkdir()
    mod.write_card(out, card, tmp_path)
    assert json.loads((out / "card.json").read_text())["eval_command"] == "draftheads eval --head runs/reference/extended/head"
    md = (out / "CARD.md").read_text()
    assert "--head runs/reference/extended/head" in md and str(mod.ROOT) not in md


def test_only_runs_the_named_stages_and_leaves_the_others(tmp_path):
    mod = _script()
    run = mod.Run(tmp_path, only=frozenset({"scaling"}))
    run.stage("extend", tmp_path / "extended2/head", lambda: (_ for _ in ()).throw(AssertionError("ran")))
    made = tmp_path / "scaling/scaling.json"
    run.stage("scaling", made, lambda: (made.parent.mkdir(), made.write_text("[]")))
    assert made.is_file()
    assert "=== extend: not run (not in --only)" in (tmp_path / "log.txt").read_text()


def test_only_refuses_a_stage_whose_input_is_unfinished(tmp_path, monkeypatch, capsys):
    mod = _script()
    monkeypatch.setattr("sys.argv", ["reference_head.py", "--run", str(tmp_path), "--only", "scaling", "--dtype",
                                     "float32", "--precision", "32"])
    with pytest.raises(SystemExit) as e:
        mod.main()
    assert "--only scaling reads what features makes, and it is not finished" in str(e.value)
    assert not (tmp_path / "scaling").exists()
    monkeypatch.setattr("sys.argv", ["reference_head.py", "--run", str(tmp_path), "--only", "scaling,nope"])
    with pytest.raises(SystemExit) as e:
        mod.main()
    assert "--only ['nope'] unknown" in str(e.value)


def test_the_scaling_curve_goes_on_the_card_of_a_head_trained_on_the_same_data(tmp_path, monkeypatch):
    mod = _script()
    data = {"train": {"answer_tokens": 100, "tokens": 150, "conversations": 3}}
    shipped, root = tmp_path / "shipped", tmp_path / "run"
    (root / "scaling").mkdir(parents=True)
    shipped.mkdir()
    (shipped / "card.json").write_text(json.dumps({"data": data}))
    (shipped / "CARD.md").write_text("# head\n\n## Eval\n\nthe eval\n\n## Bench\n\nthe bench\n")
    points = [_point(50, [0.3]), _point(100, [0.4])]
    (root / "scaling/scaling.json").write_text(json.dumps(points))
    (root / "scaling/scaling.md").write_text("| the curve |\n")
    monkeypatch.setattr(mod, "feature_tokens", lambda features: data)
    args = Namespace(package_dir=str(shipped))
    mod._card_scaling(mod.Run(root), root, root / "features", args)
    md = (shipped / "CARD.md").read_text()
    assert md.startswith("# head\n\n## Eval\n\nthe eval\n\n## Bench\n\nthe bench\n\n## Data scaling\n\n`python ")
    assert md.endswith("| the curve |\n")
    assert json.loads((shipped / "card.json").read_text())["scaling"]["points"] == points
    (root / "scaling/scaling.md").write_text("| a new curve |\n")
    (root / "scaling/scaling.json").write_text(json.dumps(points[1:]))
    mod._card_scaling(mod.Run(root), root, root / "features", args)
    md = (shipped / "CARD.md").read_text()
    assert md.count("## Data scaling") == 1 and md.endswith("| a new curve |\n") and "the bench" in md
    monkeypatch.setattr(mod, "feature_tokens", lambda features: {"train": {"answer_tokens": 7}})  # other data
    (root / "scaling/scaling.json").write_text(json.dumps(points))
    mod._card_scaling(mod.Run(root), root, root / "features", args)
    assert json.loads((shipped / "card.json").read_text())["scaling"]["points"] == points[1:]


def test_a_section_is_replaced_in_the_middle_of_a_card():
    mod = _script()
    md = "# t\n\n## A\n\nold\n\n## B\n\nb\n"
    assert mod.with_section(md, "A", "new") == "# t\n\n## A\n\nnew\n\n## B\n\nb\n"


def test_a_redone_stage_leaves_none_of_its_old_tables(tmp_path, monkeypatch):
    mod = _script()
    for f in ("eval/results.json", "eval/results.md", "eval/tau_by_domain.png", "bench/results.md"):
        (tmp_path / f).parent.mkdir(exist_ok=True)
        (tmp_path / f).write_text("old")
    monkeypatch.setattr("sys.argv", ["reference_head.py", "--run", str(tmp_path), "--redo", "eval", "--only", "eval",
                                     "--dtype", "float32", "--precision", "32"])
    with pytest.raises(SystemExit, match="--only eval reads what extend makes"):  # no head: nothing to evaluate
        mod.main()
    assert not (tmp_path / "eval").exists() and not (tmp_path / "bench").exists()  # a redo redoes what follows


def test_only_refuses_a_redo_of_its_input_before_removing_anything(tmp_path, monkeypatch):
    mod = _script()
    (tmp_path / "features").mkdir()
    (tmp_path / "features/index.json").write_text("{}")
    monkeypatch.setattr("sys.argv", ["reference_head.py", "--run", str(tmp_path), "--redo", "distill", "--only",
                                     "scaling", "--dtype", "float32", "--precision", "32"])
    with pytest.raises(SystemExit, match="--only scaling reads what features makes, and --redo makes features again"):
        mod.main()
    assert (tmp_path / "features/index.json").is_file()  # a redo of distill would have removed the features


def test_a_stage_in_only_counts_as_made_for_the_stages_after_it():
    mod = _script()
    assert mod.unmet_need(frozenset({"extend", "eval"}), "extend", lambda n: False) == ("extend", "train")
    assert mod.unmet_need(frozenset({"train", "extend", "eval"}), "extend", lambda n: n == "features") is None
    assert mod.unmet_need(frozenset({"eval"}), "train", lambda n: n == "train") is None


def test_a_warm_restart_takes_restart_lr_and_a_new_head_the_configs(tmp_path):
    import yaml

    mod = _script()
    base = yaml.safe_load((mod.ROOT / "configs/smollm2-eagle3-reference.yaml").read_text())["model"]["init_args"]["lr"]

    def model(args, init):
        cfg = mod.train_config(tmp_path, "main", args, init_head=init)
        return yaml.safe_load(cfg.read_text())["model"]["init_args"]

    args = Namespace(epochs=1, precision="32", restart_lr=3e-4)
    restarted = model(args, tmp_path / "shipped")
    assert restarted["lr"] == 3e-4 and restarted["init_head"] == str(tmp_path / "shipped")
    assert model(args, None)["lr"] == base and "init_head" not in model(args, None)
    assert model(Namespace(epochs=1, precision="32", restart_lr=None), tmp_path / "shipped")["lr"] == base


def test_intermediate_size_reaches_the_eagle3_config_beside_a_warm_restart(tmp_path):
    import yaml

    mod = _script()
    args = Namespace(epochs=1, precision="32", restart_lr=3e-4, intermediate_size=3072)
    cfg = mod.train_config(tmp_path, "main", args, init_head=tmp_path / "shipped", model=mod.eagle3_shape(args))
    init = yaml.safe_load(cfg.read_text())["model"]["init_args"]
    assert (init["intermediate_size"], init["init_head"], init["lr"]) == (3072, str(tmp_path / "shipped"), 3e-4)
    assert mod.eagle3_shape(Namespace(intermediate_size=None)) == {}


def test_from_answer_caches_features_for_the_answers_from_that_one_on(tmp_path):
    mod = _script()
    data = tmp_path / "data/train.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps({"id": f"p{i}"}) + "\n" for i in range(5)))
    assert mod.sliced_answers(data, 0) == data and mod.features_from(tmp_path) == 0
    answers = mod.sliced_answers(data, 3)
    mod._slice(data, answers, 3, tmp_path)
    assert [json.loads(x)["id"] for x in answers.read_text().splitlines()] == ["p3", "p4"]
    assert mod.features_from(tmp_path) == 3  # a rerun with another --from-answer makes the features again
    with pytest.raises(SystemExit, match="holds 5 answers"):
        mod._slice(data, mod.sliced_answers(data, 5), 5, tmp_path)


def test_the_lineage_counts_each_runs_training_tokens(tmp_path):
    """A card from before the count takes its own data's; the demo's reference row names every run's."""
    mod = _script()
    (tmp_path / "main").mkdir()
    (tmp_path / "main/init-card.json").write_text(json.dumps(
        {"date": "2026-12-04", "command": "c1", "data": {"train": {"answer_tokens": 1000}},
         "lineage": [{"date": "2026-12-04", "command": "c1", "epochs": 8}]}))
    runs = mod.lineage(tmp_path, Namespace(epochs=1, extend_epochs="0"), answer_tokens=900)
    assert [(r["epochs"], r["answer_tokens"]) for r in runs] == [(8, 1000), (1, 900)]
    demo = load_script("demo")
    assert demo.trained_tokens({"lineage": runs, "data": {"train": {"answer_tokens": 900}}}) == "1,000 + 900"
    assert demo.trained_tokens({"lineage": [{"epochs": 8}], "data": {"train": {"answer_tokens": 1000}}}) == "1,000"
