import json
from pathlib import Path

from draftheads.recipe import package as pkg


def _packaging(root: Path, where: Path, checkout: Path = Path("/nowhere")) -> pkg.Packaging:
    return pkg.Packaging(root, where, "the head", "chain3", "draftheads recipe run recipes/x.yaml", checkout)


def _card(**kw) -> dict:
    card = {"command": "c", "date": "d", "machine_plain_tok_s": 29.3, "stage_seconds": {"train": 600.0},
            "stage_machines_plain_tok_s": {"train": [29.3]},
            "data": {"train": {"conversations": 3, "answer_tokens": 30, "tokens": 40}},
            "val": {"accuracies": [0.5], "sim_tau": 1.5, "draft_vocab_coverage": None, "draft_vocab_size": 8},
            "lineage": [], "bench": None}
    return card | kw


def test_a_head_trained_on_from_a_packaged_one_lists_every_run_and_waits_for_its_bench(tmp_path):
    """The card's lineage is the init head's, then this run's epochs; the card written by package, before
    bench, says the bench is still to come."""
    init = tmp_path / "main/init-card.json"
    init.parent.mkdir()
    init.write_text(json.dumps({"date": "2026-12-03", "command": "c0", "lineage": [
        {"date": "2026-12-03", "command": "c0", "epochs": 1}]}))
    runs = pkg.lineage(init, "c1", 6)
    assert [r["epochs"] for r in runs] == [1, 6] and runs[0]["date"] == "2026-12-03" and runs[1]["command"] == "c1"
    p = _packaging(tmp_path, tmp_path / "out")
    md = pkg.card_markdown(p, _card(lineage=runs), "| eval |", "", "")
    assert md.startswith("# the head\n") and "load it with `--head " in md
    assert "Trained over 2 runs" in md and "(7 epochs in all)" in md and "Not measured yet" in md
    assert "machines at" not in md  # one machine, the card's own
    md = pkg.card_markdown(p, _card(bench={"dtype": "bfloat16"}, stage_machines_plain_tok_s={"train": [13.3, 29.3]}),
                           "| eval |", "| bench |", "")
    assert "| bench |" in md and "Not measured" not in md and "train 10.0 min (machines at 13.3 + 29.3 tok/s)" in md


def test_the_lineage_counts_each_runs_training_tokens(tmp_path):
    """A card from before the count takes its own data's; the demo's reference row names every run's."""
    init = tmp_path / "init-card.json"
    init.write_text(json.dumps({"date": "2026-12-04", "command": "c1", "data": {"train": {"answer_tokens": 1000}},
                                "lineage": [{"date": "2026-12-04", "command": "c1", "epochs": 8}]}))
    runs = pkg.lineage(init, "c2", 1, answer_tokens=900)
    assert [(r["epochs"], r["answer_tokens"]) for r in runs] == [(8, 1000), (1, 900)]
    assert pkg.trained_tokens({"lineage": runs, "data": {"train": {"answer_tokens": 900}}}) == "1,000 + 900"
    assert pkg.trained_tokens({"lineage": [{"epochs": 8}], "data": {"train": {"answer_tokens": 1000}}}) == "1,000"
    assert [r["command"] for r in pkg.lineage(tmp_path / "none.json", "c", 2)] == ["c"]


def test_a_card_names_paths_inside_the_checkout_from_the_checkout(tmp_path):
    checkout = tmp_path / "checkout"
    root = checkout / "runs/reference"
    (root / "eval").mkdir(parents=True)
    (root / "eval/results.md").write_text(f"`draftheads eval --head {root}/extended/head`\n")
    card = _card(eval_command=f"draftheads eval --head {root}/extended/head")
    out = tmp_path / "card"
    out.mkdir()
    pkg.write_card(_packaging(root, out, checkout), out, card)
    assert json.loads((out / "card.json").read_text())["eval_command"] == "draftheads eval --head runs/reference/extended/head"
    md = (out / "CARD.md").read_text()
    assert "--head runs/reference/extended/head" in md and str(checkout) not in md


def test_the_card_counts_the_conversations_packed_in_every_row_of_every_shard(tmp_path):
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
    counts = pkg.feature_tokens(tmp_path)
    assert counts["train"] == {"answer_tokens": 15, "tokens": 15, "conversations": 8}
    assert counts["val"] == {"answer_tokens": 4, "tokens": 4, "conversations": 4}


def test_the_scaling_curve_goes_on_the_card_of_a_head_trained_on_the_same_data(tmp_path, monkeypatch):
    data = {"train": {"answer_tokens": 100, "tokens": 150, "conversations": 3}}
    shipped, root = tmp_path / "shipped", tmp_path / "run"
    (root / "scaling").mkdir(parents=True)
    shipped.mkdir()
    (shipped / "card.json").write_text(json.dumps({"data": {**data, "from_answer": 0}}))
    (shipped / "CARD.md").write_text("# head\n\n## Eval\n\nthe eval\n\n## Bench\n\nthe bench\n")
    points = [{"answer_tokens": 50}, {"answer_tokens": 100}]
    (root / "scaling/scaling.json").write_text(json.dumps(points))
    (root / "scaling/scaling.md").write_text("| the curve |\n")
    monkeypatch.setattr(pkg, "feature_tokens", lambda features: data)
    p = _packaging(root, shipped)
    pkg.card_scaling(p, root / "features", print)
    md = (shipped / "CARD.md").read_text()
    assert md.startswith("# head\n\n## Eval\n\nthe eval\n\n## Bench\n\nthe bench\n\n## Data scaling\n\n`draftheads ")
    assert md.endswith("| the curve |\n")
    assert json.loads((shipped / "card.json").read_text())["scaling"]["points"] == points
    (root / "scaling/scaling.md").write_text("| a new curve |\n")
    (root / "scaling/scaling.json").write_text(json.dumps(points[1:]))
    pkg.card_scaling(p, root / "features", print)
    md = (shipped / "CARD.md").read_text()
    assert md.count("## Data scaling") == 1 and md.endswith("| a new curve |\n") and "the bench" in md
    monkeypatch.setattr(pkg, "feature_tokens", lambda features: {"train": {"answer_tokens": 7}})  # other data
    (root / "scaling/scaling.json").write_text(json.dumps(points))
    pkg.card_scaling(p, root / "features", print)
    assert json.loads((shipped / "card.json").read_text())["scaling"]["points"] == points[1:]


def test_a_section_is_replaced_in_the_middle_of_a_card():
    md = "# t\n\n## A\n\nold\n\n## B\n\nb\n"
    assert pkg.with_section(md, "A", "new") == "# t\n\n## A\n\nnew\n\n## B\n\nb\n"
    assert pkg.with_section("# t\n", "C", "c") == "# t\n\n## C\n\nc\n"
