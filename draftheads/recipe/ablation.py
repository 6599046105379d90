"""The ablation table of a recipe's first head: arms trained for the same optimizer steps on the same rows from
the same start, each ranked by walked τ (the eval's greedy τ replayed in minutes, ``draftheads walk``) beside
its validation accuracy and its training rate. ``draftheads report`` renders a committed ``results.json``."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path


def row(arm, where: Path, cwd: Path | None = None, plain_tok_s: list[float] | None = None) -> dict:
    """One finished arm (``where``: its directory, holding ``train.yaml``, ``head/`` and ``walk/``), its
    commands' paths shown from ``cwd`` where they lie under it; ``plain_tok_s``: the plain decode rate of each
    machine the arm ran on (the yardstick its training rate is read against)."""
    meta = json.loads((where / "head/config.json").read_text())
    walk = json.loads((where / "walk/results.json").read_text())
    overrides = {k: v for k, v in (("model", arm.model), ("trainer", arm.trainer), ("data", arm.data),
                                   ("features", {"features_dtype": arm.features_dtype} if arm.features_dtype else {})) if v}
    return {"name": arm.name, "overrides": overrides, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "plain_tok_s": plain_tok_s or None,
            "command": _from(f"train-head fit --config {where / 'train.yaml'}", cwd),
            "walk_command": _from(walk["command"], cwd),
            "walked_tau": {m: r["overall"]["tau"] for m, r in walk["modes"].items()},
            "walked_alpha": {m: r["overall"]["alpha"] for m, r in walk["modes"].items()},
            "val_acc": meta.get("val_accuracies"), "val_window": meta.get("val_answer_window"),
            "val_window_acc": meta.get("val_window_accuracies"), "val_window_sim_tau": meta.get("val_window_sim_tau"),
            "tok_s": train_rate(where / "train")}


def earlier_rows(recipe, path: Path, cwd: Path | None = None) -> dict[str, dict]:
    """The arms of an ablation table written before, by name, where it ablated this recipe's head config for the
    same steps, walked modes and prompts (a table of other settings does not compare, and is refused)."""
    from draftheads.errors import DraftheadsError

    try:
        res = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DraftheadsError(f"recipe field ablation.earlier: cannot read {path} ({e}); give an ablation "
                              "results.json, or leave the field out") from None
    a, e = recipe.ablation, recipe.eval
    want = {"kind": "ablation", "head_config": recipe.head.config, "steps": a.steps, "modes": a.modes,
            "prompts": e.prompts, "limit_per_domain": a.limit_per_domain, "max_new_tokens": e.max_new_tokens}
    if differ := [k for k, v in want.items() if res.get(k) != v]:
        raise DraftheadsError(f"recipe field ablation.earlier: {path} was written with other {', '.join(differ)} "
                              f"({', '.join(f'{res.get(k)!r} here {want[k]!r}' for k in differ)}); its arms do not "
                              "compare: leave the field out, or match the settings")
    return {r["name"]: {**r, "date": r.get("date", res.get("date")), "plain_tok_s": r.get("plain_tok_s"),
                        "command": _from(r["command"], cwd), "walk_command": _from(r["walk_command"], cwd)}
            for r in res.get("arms", [])}


def _from(command: str, cwd: Path | None) -> str:
    """``command`` with the paths under ``cwd`` shown from it."""
    return command.replace(f"{cwd.resolve()}/", "") if cwd is not None else command


def train_rate(root: Path) -> float | None:
    """The fit's last logged ``train/tok_s`` (padded target tokens per second since the fit's process began,
    its validations included), from the CSV logger's latest version under ``root``."""
    files = sorted(root.glob("**/metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not files:
        return None
    with files[-1].open() as f:
        rates = [float(r["train/tok_s"]) for r in csv.DictReader(f) if r.get("train/tok_s")]
    return rates[-1] if rates else None


def results(recipe, rows: list[dict], out: Path) -> dict:
    from draftheads.evaluation import machine

    a, e = recipe.ablation, recipe.eval
    return {"kind": "ablation", "recipe": recipe.name, "head_config": recipe.head.config, "steps": a.steps,
            "val_every": a.val_every, "modes": a.modes, "prompts": e.prompts, "limit_per_domain": a.limit_per_domain,
            "max_new_tokens": e.max_new_tokens, "out": str(out), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": machine(), "arms": rows}


def _overrides(o: dict) -> str:
    flat = [f"{k}: {json.dumps(v)}" for part in o.values() for k, v in part.items()]
    return ", ".join(flat) or "(the config as it is)"


def _steps(acc: list[float] | None) -> str:
    return " / ".join(f"{x:.3f}" for x in acc) if acc else "–"


def markdown(res: dict) -> str:
    """The arms side by side: walked τ per mode (and against the first arm), validation top-1 per TTT step
    over each answer's first tokens and over whole answers, the training rate and the command."""
    modes, arms = res["modes"], res["arms"]
    base = arms[0]["walked_tau"] if arms else {}
    window = next((r["val_window"] for r in arms if r.get("val_window")), None)
    lines = [f"`{res['recipe']}` ({res['head_config']}), ablation arms of {res['steps']} optimizer steps each, from "
             f"the same start on the same rows; walked τ on `{res['prompts']}` ({res['limit_per_domain']} prompts "
             f"per domain, {res['max_new_tokens']} new tokens, T = 0); train tok/s: padded target tokens per second "
             f"over the fit, its validations included, read against the plain decode rate of the machine it ran "
             f"on (machines differ 2-3×); rendered {res['date']} with {len(arms)} arms done", "",
             "| arm | overrides | " + " | ".join(f"walked τ {m}" for m in modes) + " | "
             + (f"val top-1 per step (first {window} tokens) | " if window else "")
             + "val top-1 per step | train tok/s (machine's plain decode tok/s) |", "|---" * (len(modes) + 4 + bool(window)) + "|"]
    for r in arms:
        taus = []
        for m in modes:
            tau = r["walked_tau"].get(m)
            delta = f" ({100 * (tau / base[m] - 1):+.1f} %)" if r is not arms[0] and tau and base.get(m) else ""
            taus.append(f"{tau:.3f}{delta}" if tau is not None else "–")
        rate = f"{r['tok_s']:.0f}" if r.get("tok_s") else "–"
        if r.get("plain_tok_s"):
            rate += f" ({' / '.join(f'{p:.1f}' for p in r['plain_tok_s'])})"
        lines.append(f"| {r['name']} | {_overrides(r['overrides'])} | " + " | ".join(taus) + " | "
                     + (f"{_steps(r.get('val_window_acc'))} | " if window else "")
                     + f"{_steps(r.get('val_acc'))} | {rate} |")
    lines += ["", "Commands (each arm's `train.yaml` is the config with its overrides and paths under the run):", ""]
    lines += [f"- {r['name']}: `{r['command']}`; `{r['walk_command']}`" for r in arms]
    return "\n".join(lines) + "\n"
