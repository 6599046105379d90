import json

from draftheads.prompts import load_prompts
from draftheads.recipe import store as store_mod
from draftheads.recipe.runner import Run
from draftheads.recipe.stages import grows
from draftheads.recipe.store import DataStore


def test_a_data_store_keeps_the_text_as_it_grows_and_seeds_a_fresh_run(tmp_path):
    """A run saves its synthesized prompts to the store while they are partial, then finished (the partial
    files go); a fresh run directory starts from the store with the stage's time so far, and a redone
    stage is dropped from it."""
    a = Run(tmp_path / "a")
    a.times.update(plain_tok_s=13.3, running={"synthesize": 100.0}, machines={"synthesize": [13.3]})
    store = DataStore(tmp_path / "store", tmp_path / "a/data", [])
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

    b = Run(tmp_path / "b")
    b.times["plain_tok_s"] = 29.3
    DataStore(store.root, tmp_path / "b/data", []).seed(b)
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
    c = Run(tmp_path / "c")
    DataStore(store.root, tmp_path / "c/data", []).seed(c)
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
    d = Run(tmp_path / "d")
    DataStore(store.root, tmp_path / "d/data", []).seed(d)
    assert (tmp_path / "d/data/synth.jsonl.partial").read_text().count("\n") == 3
    assert not (tmp_path / "d/data/synth.jsonl").exists()
    store.drop("synthesize")
    assert sorted(p.name for p in store.root.iterdir()) == ["stages.json"]


def test_more_prompts_than_the_store_holds_grow_a_fresh_run(tmp_path):
    """A fresh run directory (a fresh clone) seeded from a store of finished prompts grows them when asked for
    more, as a run holding them itself does; a run with partial prompts of its own resumes them instead."""
    store = tmp_path / "store"
    store.mkdir()
    (store / "synth.jsonl").write_text('{"id": "syn-chat-000001"}\n{"id": "syn-code-000001"}\n')
    (store / "synth.jsonl.stats.json").write_text('{"total": 2}')
    fresh = tmp_path / "fresh/data"
    seeded = DataStore(store, fresh, [])
    assert seeded.seeds("synthesize") == store / "synth.jsonl" and seeded.seeds("distill") is None
    assert grows(fresh / "synth.jsonl", seeded, 4) and not grows(fresh / "synth.jsonl", seeded, 2)
    assert not grows(fresh / "synth.jsonl", None, 4)  # no store, no prompts: synthesize writes all 4
    own = tmp_path / "own/data"
    own.mkdir(parents=True)
    (own / "synth.jsonl").write_text('{"id": "syn-chat-000001"}\n')
    (own / "synth.jsonl.stats.json").write_text('{"total": 1}')
    assert grows(own / "synth.jsonl", DataStore(store, own, []), 2)  # its own 1, not the store's 2
    partial = tmp_path / "partial/data"
    partial.mkdir(parents=True)
    (partial / "synth.jsonl.partial").write_text("")
    (partial / "synth.jsonl.partial.json").write_text("{}")
    assert DataStore(store, partial, []).seeds("synthesize") is None
    assert not grows(partial / "synth.jsonl", DataStore(store, partial, []), 4)


def test_the_store_keeps_distilled_records_without_the_turns_their_prompts_hold(tmp_path):
    """Turns are left out of the stored answers and put back, byte for byte, when a run is seeded; a line
    still being written is left out."""
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
    store = DataStore(tmp_path / "store", data, [])
    store.save({})
    stored = (store.root / "train.jsonl.partial").read_text()
    assert "turns" not in stored and stored.count("\n") == 2
    run = Run(tmp_path / "b")
    DataStore(store.root, tmp_path / "b/data", ["bundled:train", str(tmp_path / "b/data/synth.jsonl")]).seed(run)
    assert (tmp_path / "b/data/train.jsonl.partial").read_text() == text


def test_the_store_keeps_a_large_file_in_parts_cut_at_line_ends(tmp_path, monkeypatch):
    monkeypatch.setattr(store_mod, "PART_BYTES", 100)
    data = tmp_path / "a/data"
    data.mkdir(parents=True)
    lines = [f'{{"id": "syn-{i:03d}", "domain": "qa", "turns": ["{"why " * (i % 5)}?"]}}\n' for i in range(12)]
    (data / "synth.jsonl.partial.json").write_text("{}")
    (data / "synth.jsonl.partial").write_text("".join(lines[:6]))
    store = DataStore(tmp_path / "store", data, [])
    store.save({})
    (data / "synth.jsonl.partial").rename(data / "synth.jsonl")  # finished, grown
    (data / "synth.jsonl.partial.json").rename(data / "synth.jsonl.stats.json")
    (data / "synth.jsonl").write_text("".join(lines))
    store.save({})
    names = sorted(p.name for p in store.root.iterdir())
    parts = [store.root / n for n in names if n.startswith("synth.jsonl.part")]
    assert len(parts) > 2 and "synth.jsonl" not in names and not any("partial" in n for n in names)
    assert all(len(p.read_bytes()) <= 100 and p.read_text().endswith("\n") for p in parts)
    assert DataStore(store.root, tmp_path / "b/data", []).holds(store.root, "synthesize") is True
    DataStore(store.root, tmp_path / "b/data", []).seed(Run(tmp_path / "b"))
    assert (tmp_path / "b/data/synth.jsonl").read_text() == "".join(lines)
    monkeypatch.setattr(store_mod, "PART_BYTES", 1 << 20)  # small again: one file, no parts left
    store.save({})
    assert (store.root / "synth.jsonl").read_text() == "".join(lines)
    assert not list(store.root.glob("synth.jsonl.part*"))
    store.drop("synthesize")
    assert not list(store.root.glob("synth.jsonl*"))
