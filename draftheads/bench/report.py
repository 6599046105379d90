"""``draftheads report``: every results table the docs publish, rendered from the JSON its command wrote.

* Each ``docs/results/**/results.json`` (written by ``draftheads eval``, ``walk``, ``bench``, ``serve-check``,
  ``scripts/bench_train_step.py``, ``scripts/vllm_distill_check.py``, a recipe's ablation, or a ``synthesize``
  run's ``OUT.stats.json``) gets its ``results.md`` beside it, by that command's own renderer.
* The README's headline table, between its ``headline`` markers, from the shipped head's ``card.json`` (written
  by the recipe's package and bench stages): τ per mode on the eval and the speedups side by side.
* In the README and any page under ``docs/``, between ``<!-- results: PATH -->`` and ``<!-- /results -->``
  markers, the table of the run whose JSON is at ``PATH`` (relative to the checkout), so a page quotes a run
  without typing it.

``--check`` renders without writing and fails on any difference, as the tests do: no number is typed by hand.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from draftheads.utils import atomic_write_text

CARD = Path("draftheads/data/heads/smollm2-135m-eagle3/card.json")
"""The shipped head's card, relative to the checkout."""
START, END = "<!-- headline: `draftheads report` renders this table from {card} -->", "<!-- /headline -->"
INCLUDE = re.compile(r"(<!-- results: (\S+) -->\n)(.*?)(<!-- /results -->)", re.S)


def render_results(res: dict) -> str:
    """The table the command that wrote ``res`` writes beside it (eval, walk, bench, serve-check, synthesize or
    the training step's)."""
    from draftheads import evaluation
    from draftheads.bench import speed
    from draftheads.inference import replay

    if res.get("kind") == "ablation":
        from draftheads.recipe import ablation

        return ablation.markdown(res)
    if res.get("kind") == "walk":
        return replay.markdown(res)
    if res.get("kind") == "train_step":
        from draftheads.bench import train_step

        return train_step.markdown(res)
    if "formats" in res and "vllm_version" in res:  # ``draftheads serve-check``
        from draftheads.export import serve_check

        return serve_check.markdown(res)
    if "speed" in res and "features" in res and "text" in res:  # ``scripts/vllm_distill_check.py``
        from draftheads.datagen.backends import engines_markdown

        return engines_markdown(res)
    if "domains" in res and "settings" in res:  # the OUT.stats.json of ``draftheads synthesize``
        from draftheads.datagen import synthesize

        return synthesize.markdown(res)
    return evaluation.markdown(res) if "modes" in res else speed.tables(res)


def headline(card: dict, card_path: Path) -> str:
    """The shipped head per mode: its eval τ and speedup (float32, batch 1) and its bench speedup (the bench's
    dtype), with the commands that measured them."""
    bench = (card.get("bench") or {}).get("proposers", {})
    modes = list(dict.fromkeys([*card["eval"], *(k[len("eagle3 ("):-1] for k in bench if k.startswith("eagle3 ("))]))
    dtype = (card.get("bench") or {}).get("dtype") or "float32"
    lines = [f"| mode | τ (eval) | speedup (eval, float32) | speedup (bench, {dtype}) |", "|---|---|---|---|"]
    for m in modes:
        ev, b = card["eval"].get(m), bench.get(f"eagle3 ({m})")
        lines.append(f"| {m} | {ev['tau']:.2f} | {ev['speedup']:.2f}x |" if ev else f"| {m} | – | – |")
        lines[-1] += f" {b['ratio_vs_plain']:.2f}x |" if b else " – |"
    lines += ["", f"Eval: `{card['eval_command']}`. Bench: `{(card.get('bench') or {}).get('command', '–')}`. "
              f"Both on {card['date']} (plain decode {card['machine_plain_tok_s']:.1f} tok/s at batch 1); the card "
              f"`{card_path}` holds every number with its command."]
    return "\n".join(lines)


def render_readme(text: str, card: dict, card_path: Path) -> str:
    """``text`` with the table between its headline markers rendered again (unchanged when it has none)."""
    start = START.format(card=card_path)
    if start not in text or END not in text:
        return text
    before, rest = text.split(start, 1)
    _, after = rest.split(END, 1)
    return f"{before}{start}\n{headline(card, card_path)}\n{END}{after}"


def render_includes(text: str, root: Path) -> str:
    """``text`` with the table between each pair of results markers rendered again from the JSON it names."""
    def table(m: re.Match) -> str:
        body = render_results(json.loads((root / m.group(2)).read_text()))
        return f"{m.group(1)}{body}{m.group(4)}"

    return INCLUDE.sub(table, text)


def report(root: Path, write: bool = True) -> list[Path]:
    """Render every table under ``root`` (a checkout); returns the files whose text differs from the render
    (written when ``write``)."""
    out = {}
    for res in sorted((root / "docs/results").rglob("results.json")):
        out[res.with_name("results.md")] = render_results(json.loads(res.read_text()))
    readme = root / "README.md"
    for page in [readme, *sorted((root / "docs").rglob("*.md"))]:
        if page.name != "results.md" and page.is_file():
            text = page.read_text()
            if INCLUDE.search(text):
                out[page] = render_includes(text, root)
    card = root / CARD
    if card.is_file():
        out[readme] = render_readme(out.get(readme) or readme.read_text(), json.loads(card.read_text()), CARD)
    changed = [p for p, text in out.items() if not p.is_file() or p.read_text() != text]
    if write:
        for p in changed:
            atomic_write_text(p, out[p])
    return changed
