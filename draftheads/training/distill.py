"""Self-distillation: regenerate answers with the target itself (the recommended data for heads).

Writes ``{"id", "domain", "turns", "answers"}`` lines. Multi-turn prompts feed the target's own
earlier answers back. Progress goes to ``OUT.partial`` (resumed on restart) and is renamed to ``OUT``
when complete.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from draftheads.errors import DraftheadsError
from draftheads.prompts import Prompt, render_chat


@torch.no_grad()
def generate_batch(model, tokenizer, texts: list[str], max_new_tokens: int, temperature: float, seed: int) -> list[str]:
    """Batched HF generation with left padding; returns the decoded continuations."""
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    try:
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = side
    torch.manual_seed(seed)
    out = model.generate(
        **enc.to(model.device), max_new_tokens=max_new_tokens, do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None, top_p=None, top_k=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    return [tokenizer.decode(row[enc.input_ids.shape[1]:], skip_special_tokens=True).strip() for row in out]


def distill(
    target, prompts: list[Prompt], out: str | os.PathLike, max_new_tokens: int = 256, temperature: float = 0.0,
    batch_size: int = 8, seed: int = 0, progress=print,
) -> Path:
    if temperature < 0:
        raise DraftheadsError(f"--temperature {temperature} must be >= 0")
    if max_new_tokens < 1 or batch_size < 1:
        raise DraftheadsError("--max-new-tokens and --batch-size must be >= 1")
    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    done = {}
    if partial.is_file():
        for line in partial.read_text(encoding="utf-8").splitlines():
            if line.strip():
                rec = json.loads(line)
                done[rec["id"]] = rec
    todo = [p for p in prompts if p.id not in done]
    out.parent.mkdir(parents=True, exist_ok=True)
    t0, n_tokens = time.perf_counter(), 0
    tok = target.tokenizer
    with partial.open("a", encoding="utf-8") as f:
        for s in range(0, len(todo), batch_size):
            batch = todo[s : s + batch_size]
            answers: list[list[str]] = [[] for _ in batch]
            for turn in range(max(len(p.turns) for p in batch)):
                live = [i for i, p in enumerate(batch) if turn < len(p.turns)]
                texts = []
                for i in live:
                    msgs = []
                    for q, a in zip(batch[i].turns[:turn], answers[i]):
                        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
                    msgs.append({"role": "user", "content": batch[i].turns[turn]})
                    texts.append(render_chat(tok, msgs, name=target.info.name))
                outs = generate_batch(target.model, tok, texts, max_new_tokens, temperature, seed + s + turn)
                for i, a in zip(live, outs):
                    answers[i].append(a)
                    n_tokens += len(tok(a, add_special_tokens=False).input_ids)
            for p, a in zip(batch, answers):
                f.write(json.dumps({"id": p.id, "domain": p.domain, "turns": list(p.turns), "answers": a}) + "\n")
            f.flush()
            dt = time.perf_counter() - t0
            progress(f"distill: {len(done) + s + len(batch)}/{len(prompts)} prompts, {n_tokens / dt:.1f} tok/s")
    os.replace(partial, out)
    return out
