"""The docs site builds with every warning an error (a broken link, a page the navigation names that is not
there), and the README stays a short page for users whose links reach their pages."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_site_builds_strict(tmp_path):
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[dev]')")
    proc = subprocess.run([str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "site/index.html").is_file() and (tmp_path / "site/recipes/index.html").is_file()


def test_the_readme_is_short_and_its_links_reach_pages():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    import re

    links = re.findall(r"\]\(([^)#]+)", text)
    assert links and all((ROOT / link).is_file() for link in links), [x for x in links if not (ROOT / x).is_file()]
