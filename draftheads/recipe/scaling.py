"""The data-scaling curve of a recipe's first head: validation accuracy per TTT step and chain-3 τ against
training tokens, every point trained for as many optimizer steps as the first fit (a smaller subset is
seen more often), so that the curve compares data at equal compute."""

from __future__ import annotations

from pathlib import Path


def schedule(epochs: int, fraction: float) -> dict:
    """Trainer settings of a point on ``fraction`` of the data when the whole set trains ``epochs``: as many
    steps, validated as often in all."""
    times = max(1, round(1 / fraction))
    return {"max_epochs": epochs * times, "val_check_interval": 1.0 if times > 1 else 0.5,
            "check_val_every_n_epoch": max(1, times // 2)}


def point(fraction: float, answer_tokens: int, epochs: int, meta: dict, chain3: dict) -> dict:
    """One point: the head's validation record (``meta``, its config.json) and its chain-3 eval."""
    return {"fraction": fraction, "answer_tokens": int(round(fraction * answer_tokens)), "epochs": epochs,
            "val_acc": meta.get("val_accuracies"), "val_sim_tau": meta.get("val_sim_tau"),
            "val_window": meta.get("val_answer_window"), "val_window_acc": meta.get("val_window_accuracies"),
            "val_window_sim_tau": meta.get("val_window_sim_tau"),
            "tau_chain3": chain3["tau"], "speedup_chain3": chain3["speedup"]}


def table(points: list[dict], per_domain: int, tokens: int) -> str:
    k = max(len(p["val_acc"] or []) for p in points)
    window = next((p["val_window"] for p in points if p.get("val_window")), None)
    lines = [f"chain-3 τ on the eval ({per_domain} prompts per domain, "
             f"{tokens} new tokens, T = 0); validation top-1 per TTT step over whole answers"
             + (f", and step 1 and simulated τ over each answer's first {window} tokens" if window else "")
             + "; every subset trained for as many steps as the full set (more epochs)", "",
             "| train answer tokens | epochs | " + " | ".join(f"val acc@{j + 1}" for j in range(k)) + " | sim τ (val) | "
             + (f"val acc@1 (first {window}) | sim τ (first {window}) | " if window else "")
             + "τ chain 3 | speedup chain 3 |", "|---" * (k + 5 + 2 * bool(window)) + "|"]
    for p in points:
        acc = " | ".join(f"{a:.3f}" for a in p["val_acc"] or [])
        win = ""
        if window:
            w = p.get("val_window_acc")
            win = f"{w[0]:.3f} | {p['val_window_sim_tau']:.2f} | " if w else "– | – | "
        lines.append(f"| {p['answer_tokens']:,} | {p.get('epochs', '–')} | {acc} | {p['val_sim_tau'] or 0:.2f} | {win}"
                     f"{p['tau_chain3']:.2f} | {p['speedup_chain3']:.2f}x |")
    return "\n".join(lines) + "\n"


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    xs = [p["answer_tokens"] for p in points]
    for j in range(max(len(p["val_acc"] or []) for p in points)):
        a.plot(xs, [(p["val_acc"] or [0] * (j + 1))[j] for p in points], marker="o", label=f"step {j + 1}")
    a.set_xscale("log")
    a.set_xlabel("training answer tokens")
    a.set_ylabel("validation top-1")
    a.legend(fontsize=7)
    b.plot(xs, [p["tau_chain3"] for p in points], marker="o", label="τ chain 3 (eval)")
    b.plot(xs, [p["val_sim_tau"] or 0 for p in points], marker="s", label="simulated τ (val)")
    b.set_xscale("log")
    b.set_xlabel("training answer tokens")
    b.set_ylabel("τ")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
