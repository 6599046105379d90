"""Every published results table is what `draftheads report` renders from the JSON its command wrote: the
tables under docs/results/ and the README's headline. A number typed by hand, or a renderer changed without
the pages rendered again, fails here."""

import json
import shutil
from pathlib import Path

import pytest

from draftheads.bench.report import CARD, report

ROOT = Path(__file__).resolve().parents[1]
RUNS = sorted((ROOT / "docs/results").rglob("results.json"))


def test_every_committed_table_is_its_json_rendered():
    assert len(RUNS) >= 7
    assert report(ROOT, write=False) == []


@pytest.fixture
def copy(tmp_path):
    shutil.copytree(ROOT / "docs/results", tmp_path / "docs/results")
    (tmp_path / CARD).parent.mkdir(parents=True)
    shutil.copy(ROOT / CARD, tmp_path / CARD)
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    return tmp_path


def test_a_number_typed_by_hand_is_found_and_rendered_again(copy):
    readme = copy / "README.md"
    readme.write_text(readme.read_text().replace("| chain3 | 2.07 |", "| chain3 | 2.17 |"))
    table = sorted((copy / "docs/results").rglob("results.md"))[0]
    table.write_text(table.read_text().replace("x", "X", 1))
    assert sorted(report(copy, write=False)) == sorted([readme, table])
    report(copy)
    assert report(copy, write=False) == [] and "| chain3 | 2.07 |" in readme.read_text()


def test_the_headline_follows_the_card(copy):
    card = json.loads((copy / CARD).read_text())
    card["eval"]["chain3"]["tau"] = 2.5
    (copy / CARD).write_text(json.dumps(card))
    assert report(copy) == [copy / "README.md"] and "| chain3 | 2.50 |" in (copy / "README.md").read_text()


def test_a_topic_page_quotes_a_run_between_results_markers(copy):
    run = RUNS[0].relative_to(ROOT)
    page = copy / "docs/topic.md"
    page.write_text(f"# Topic\n\n<!-- results: {run} -->\n| typed | 9.99x |\n<!-- /results -->\n\nAfter.\n")
    assert report(copy) == [page]
    text = page.read_text()
    assert "9.99x" not in text and (copy / run).with_name("results.md").read_text() in text
    assert text.endswith("<!-- /results -->\n\nAfter.\n") and report(copy, write=False) == []
