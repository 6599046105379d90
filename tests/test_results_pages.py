"""Every results table under docs/results/ is what its command's own renderer makes of the JSON beside it:
re-rendered here, a committed table that differs (a number typed by hand, or a renderer that changed
without the pages being rendered again) fails."""

import json
from pathlib import Path

import pytest

from draftheads import evaluation
from draftheads.bench import speed

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
RUNS = sorted(RESULTS.rglob("results.json"))


def render(res: dict) -> str:
    """The table the command that wrote ``res`` wrote beside it (eval or bench)."""
    return evaluation.markdown(res) if "modes" in res else speed.tables(res)


@pytest.mark.parametrize("path", RUNS, ids=lambda p: str(p.parent.relative_to(RESULTS)))
def test_a_committed_results_table_is_its_json_rendered(path):
    assert path.with_name("results.md").read_text() == render(json.loads(path.read_text()))


def test_the_results_folders_are_found():
    assert len(RUNS) >= 7
