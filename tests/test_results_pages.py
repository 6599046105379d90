"""Every published results table is what `draftheads report` renders from the JSON its command wrote: the
tables under docs/results/ and the README's headline. A number typed by hand, or a renderer changed without
the pages rendered again, fails here."""

import json
import re
import shutil
from pathlib import Path

import pytest

from draftheads.bench.report import CARD, END, INCLUDE, START, report

ROOT = Path(__file__).resolve().parents[1]
RUNS = sorted((ROOT / "docs/results").rglob("results.json"))


def test_every_committed_table_is_its_json_rendered():
    assert len(RUNS) >= 7
    assert report(ROOT, write=False) == []


TYPED = re.compile(r"\d\.\d+ ?[x×]|τ \d")  # a speedup or a τ


def typed(text: str) -> list[str]:
    """The lines of ``text`` outside its results markers that state a speedup or a τ."""
    return [line for line in INCLUDE.sub("", text).splitlines() if TYPED.search(line)]


def test_every_results_page_quotes_its_numbers_from_json():
    """A page under docs/results is a run's rendered results.md, or a dated folder's README.md that quotes its
    runs between results markers and types no speedup or τ of its own."""
    for page in sorted((ROOT / "docs/results").rglob("*.md")):
        if page.name == "results.md":
            assert page.with_name("results.json").is_file(), page
            continue
        assert page.name == "README.md" and any(page.parent.rglob("results.json")), page
        assert typed(page.read_text()) == [], page


def test_no_topic_page_types_a_speedup_or_tau():
    """The README (outside its rendered headline) and every topic page quote runs only between results markers."""
    readme = (ROOT / "README.md").read_text()
    before, rest = readme.split(START.format(card=CARD), 1)
    assert typed(before + rest.split(END, 1)[1]) == []
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert typed(page.read_text()) == [], page


def test_a_typed_speedup_outside_the_markers_is_seen():
    run = RUNS[0].relative_to(ROOT)
    quoted = f"<!-- results: {run} -->\n| chain3 | 1.54x | τ 2.07 |\n<!-- /results -->\n"
    assert typed(quoted + "Prose without numbers.\n") == []
    assert typed(quoted + "auto ran at 1.38× there.\n") == ["auto ran at 1.38× there."]


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


def test_the_readme_quotes_a_run_between_results_markers(copy):
    readme = copy / "README.md"
    text = readme.read_text()
    m = INCLUDE.search(text)
    assert m, "the README quotes vLLM serving the shipped head from its serve-check JSON"
    readme.write_text(text[: m.start(3)] + "| typed | 9.99x |\n" + text[m.end(3):])
    assert report(copy) == [readme] and readme.read_text() == text
