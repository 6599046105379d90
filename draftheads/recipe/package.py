"""Head packaging: the trained head in bfloat16 with its card (``card.json`` and ``CARD.md``), written only
when its τ on the recipe's eval beats the packaged head's. The card holds the command, the machine, the
stage times, the data, validation, the eval and (once measured) the bench and scaling tables, and the
lineage: every run the head's weights went through, warm restarts included."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from draftheads.utils import atomic_write_json, atomic_write_text


@dataclass
class Packaging:
    """What a run packages and where: ``root`` the run directory, ``checkout`` the directory paths on the
    card are shown from, ``command`` the command that made the run."""

    root: Path
    dir: Path
    title: str
    mode: str
    command: str
    checkout: Path
    load_as: str = ""
    """how the card tells users to load the head (default: ``--head DIR``)"""

    def write_file(self, path: Path, text: str) -> None:
        """A card file, naming paths inside the checkout from the checkout (the commands ran with absolute ones)."""
        atomic_write_text(path, text.replace(f"{self.checkout}/", ""))


def feature_tokens(features: Path) -> dict:
    """Per split of a feature cache: conversations, answer (loss-masked) tokens and all tokens."""
    from draftheads.training.features import FeatureDataset

    out = {}
    for split in ("train", "val"):
        ds = FeatureDataset(features, split)
        out[split] = {"answer_tokens": sum(int(m.sum()) for m in ds.column("loss_mask")),
                      "tokens": sum(int((d >= 0).sum()) for d in ds.column("doc_ids")),
                      # doc ids count 0.. within each row (-1 pads): a row holds its largest id + 1
                      "conversations": sum(int((d.amax(dim=-1) + 1).clamp(min=0).sum()) for d in ds.column("doc_ids"))}
    return out


def lineage(init_card: Path, command: str, epochs: int, answer_tokens: int | None = None) -> list[dict]:
    """Every run the packaged head's weights went through, the first first: the init head's lineage (from
    its card ``init_card``, when the first fit started from a trained head), then this run."""
    runs = []
    if init_card.is_file():
        old = json.loads(init_card.read_text())
        runs = old.get("lineage") or [{"date": old["date"], "command": old["command"], "epochs": None}]
        if len(runs) == 1 and "answer_tokens" not in runs[0] and "data" in old:  # a card from before the count
            runs = [{**runs[0], "answer_tokens": old["data"]["train"]["answer_tokens"]}]
    return runs + [{"date": time.strftime("%Y-%m-%d"), "command": command, "epochs": epochs,
                    "answer_tokens": answer_tokens}]


def trained_tokens(card: dict) -> str:
    """The answer tokens a packaged head was trained on, run by run over its lineage ("1,014,736 + 979,874")."""
    runs = card.get("lineage") or []
    if runs and all(r.get("answer_tokens") for r in runs):
        return " + ".join(f"{r['answer_tokens']:,}" for r in runs)
    return f"{card['data']['train']['answer_tokens']:,}"


def package(p: Packaging, head: Path, data: dict, evald: Path, times: dict, epochs: int, force: bool, say) -> None:
    """Write ``head`` to ``p.dir`` when its eval τ in ``p.mode`` beats the packaged one's (or ``force``), and
    record the decision in the run's ``packaged.json``. ``data``: what it trained on (:func:`feature_tokens`
    and more)."""
    import torch
    from safetensors.torch import load_file, save_file

    from draftheads.heads.base import WEIGHTS_NAME

    res = json.loads((evald / "results.json").read_text())
    tau = res["modes"][p.mode]["overall"]["tau"]
    old = p.dir / "card.json"
    if old.is_file() and not force:
        prev = json.loads(old.read_text())["eval"].get(p.mode, {}).get("tau")
        if prev is not None and tau <= prev:
            say(f"package: {p.mode} tau {tau:.3f} does not beat the packaged head's {prev:.3f}: not replaced "
                "(package.force to replace it anyway)")
            atomic_write_json(p.root / "packaged.json", {"packaged": False, "tau": tau, "committed": prev})
            return
    meta = json.loads((head / "config.json").read_text())
    weights = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v)
               for k, v in load_file(str(head / WEIGHTS_NAME)).items()}
    card = {
        "command": p.command,
        "date": time.strftime("%Y-%m-%d"),
        "machine_plain_tok_s": times.get("plain_tok_s"),
        "stage_seconds": {k: v for k, v in times.items() if k not in ("plain_tok_s", "running", "machines")},
        "stage_machines_plain_tok_s": times.get("machines", {}),
        "data": data,
        "val": {"accuracies": meta.get("val_accuracies"), "sim_tau": meta.get("val_sim_tau"),
                "draft_vocab_coverage": meta.get("draft_vocab_coverage"),
                "draft_vocab_size": meta["config"].get("draft_vocab_size")},
        "eval": {m: {"tau": v["overall"]["tau"], "alpha": v["overall"]["alpha"], "speedup": v["overall"]["speedup"],
                     "greedy_mismatches": v["overall"]["greedy_mismatches"],
                     "domains": {d: x["tau"] for d, x in v["domains"].items()}}
                 for m, v in res["modes"].items()},
        "eval_command": res["command"],
        "lineage": lineage(p.root / "main/init-card.json", p.command, epochs, data["train"]["answer_tokens"]),
        "bench": None,  # the bench stage, after this one, fills it in
    }
    tmp = p.root / "package"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file(weights, str(tmp / WEIGHTS_NAME), metadata={"head_type": meta["head_type"]})
    (tmp / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    write_card(p, tmp, card)
    if p.dir.exists():
        shutil.rmtree(p.dir)
    p.dir.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tmp, p.dir)
    size = (p.dir / WEIGHTS_NAME).stat().st_size / 2**20
    say(f"package: wrote {p.dir} ({size:.1f} MB), {p.mode} tau {tau:.3f}")
    atomic_write_json(p.root / "packaged.json", {"packaged": True, "tau": tau, "mb": size})


def packaged(root: Path) -> bool:
    """Whether the run ``root`` packaged its head."""
    f = root / "packaged.json"
    return f.is_file() and json.loads(f.read_text())["packaged"]


def write_card(p: Packaging, where: Path, card: dict) -> None:
    """``card.json`` and ``CARD.md`` of a packaged head, the tables taken from the run."""
    bench_md, scaling = p.root / "bench/results.md", p.root / "scaling/scaling.md"
    p.write_file(where / "card.json", json.dumps(card, indent=2) + "\n")
    p.write_file(where / "CARD.md", card_markdown(
        p, card, (p.root / "eval/results.md").read_text(), bench_md.read_text() if card["bench"] else "",
        scaling.read_text() if scaling.is_file() else ""))


def card_bench(p: Packaging, bench: Path, say) -> None:
    """Add the bench to the card of the head this run packaged (none when it packaged none)."""
    if not packaged(p.root):
        return
    card = json.loads((p.dir / "card.json").read_text())
    res = json.loads((bench / "results.json").read_text())
    card["bench"] = {"command": res["command"], "dtype": res.get("dtype"), "proposers": res["proposers"]}
    write_card(p, p.dir, card)
    say(f"bench: added to {p.dir}/CARD.md")


def card_scaling(p: Packaging, features: Path, say) -> None:
    """Put the scaling curve on the packaged head's card when that head was trained on this run's data (the
    curve is about the data and the recipe, and it may finish after the head was packaged)."""
    if not (p.dir / "card.json").is_file():
        return
    card = json.loads((p.dir / "card.json").read_text())
    points = json.loads((p.root / "scaling/scaling.json").read_text())
    data = {k: v for k, v in card["data"].items() if k in ("train", "val")}
    if card.get("scaling", {}).get("points") == points or data != feature_tokens(features):
        return
    card["scaling"] = {"command": p.command, "points": points}
    p.write_file(p.dir / "card.json", json.dumps(card, indent=2) + "\n")
    p.write_file(p.dir / "CARD.md", with_section((p.dir / "CARD.md").read_text(), "Data scaling", (
        f"`{card['scaling']['command']}`\n\n{(p.root / 'scaling/scaling.md').read_text()}")))
    say(f"scaling: added to {p.dir}/CARD.md")


def with_section(md: str, title: str, body: str) -> str:
    """``md`` with its ``## title`` section (up to the next ``## `` heading) replaced by ``body``, or
    ``body`` appended under that heading."""
    head = f"## {title}\n"
    text = f"{head}\n{body.strip()}\n"
    if head not in md:
        return md.rstrip("\n") + "\n\n" + text
    before, _, after = md.partition(head)
    rest = after.find("\n## ")
    return before + text + (after[rest:] if rest >= 0 else "")


def card_markdown(p: Packaging, card: dict, eval_md: str, bench_md: str, scaling_md: str) -> str:
    d = card["data"]
    machines = card.get("stage_machines_plain_tok_s", {})

    def on(stage: str) -> str:
        rates = machines.get(stage) or []
        return f" (machines at {' + '.join(f'{r:.1f}' for r in rates)} tok/s)" if len(rates) > 1 or (
            rates and rates[0] != card["machine_plain_tok_s"]) else ""

    times = ", ".join(f"{k} {v / 60:.1f} min{on(k)}" for k, v in card["stage_seconds"].items())
    val = card["val"]
    acc = " / ".join(f"{a:.3f}" for a in val["accuracies"] or [])
    cov = val["draft_vocab_coverage"] or {}
    rate = card["machine_plain_tok_s"]
    lines = [
        f"# {p.title or p.dir.name}", "",
        f"Built by `{card['command'].strip()}` on {card['date']}; load it with `{p.load_as or '--head ' + str(p.dir)}`.",
        "",
        f"- machine: plain decode {rate or 0:.1f} tok/s at batch 1 (fp32, engine); stage times "
        f"(a stage that ran on other machines names their rates): {times}",
        f"- data: {d['train']['conversations']:,} train conversations"
        + (f", {d['train']['answer_tokens']:,} answer tokens ({d['train']['tokens']:,} with prompts); val "
           f"{d.get('val', {}).get('conversations', 0):,} conversations, {d.get('val', {}).get('answer_tokens', 0):,} "
           "answer tokens" if d['train'].get('answer_tokens') is not None else "")
        + "; all written by the target itself"
        + (f" (the store's answers from number {d['from_answer']:,} on, 0-based)" if d.get("from_answer") else ""),
        f"- validation: top-1 per TTT step {acc}; simulated τ {val['sim_tau'] or 0:.2f}"
        + (f"; draft vocabulary {val['draft_vocab_size']} tokens covering {100 * (cov.get('train') or 0):.1f}% of "
           f"train and {100 * (cov.get('val') or 0):.1f}% of validation targets" if val.get("draft_vocab_size") else ""),
        "",
    ]
    runs = card.get("lineage") or []
    if len(runs) > 1:
        lines += [f"Trained over {len(runs)} runs, each a warm restart from the head before it "
                  f"({sum(r['epochs'] or 0 for r in runs)} epochs in all):", "",
                  *[f"{i}. {r['date']}: `{r['command']}`, {r['epochs'] or '?'} epoch{'' if r['epochs'] == 1 else 's'}"
                    + (f" on {r['answer_tokens']:,} answer tokens" if r.get("answer_tokens") else "")
                    for i, r in enumerate(runs, 1)],
                  ""]
    lines += ["## Eval (T = 0, batch 1; mode per row)", "", eval_md.strip(), ""]
    if card["bench"]:
        lines += [f"## Bench (side by side in one run, target and head in {card['bench'].get('dtype') or 'float32'})",
                  "", bench_md.strip(), ""]
    else:
        lines += ["## Bench", "", "Not measured yet: the `bench` stage of the command above adds it.", ""]
    if scaling_md:
        lines += ["## Data scaling", "", scaling_md.strip(), ""]
    return "\n".join(lines) + "\n"
