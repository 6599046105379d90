"""Self-distillation: the target answers the prompts itself, through the engine's continuous batching.

Writes ``{"id", "domain", "turns", "answers", "truncated"}`` lines to ``OUT``. A multi-turn prompt is one
request: after the target ends an answer, the template tokens of the next user turn are appended and it
goes on, so later turns see the target's own earlier answers. An answer cut at ``max_new_tokens`` (or
at ``max_seq_len``) is marked truncated, and the conversation stops there: it is never closed with an
end-of-turn token the target did not write.

With ``features`` (HF hidden-state ids), the hidden states of the generation pass itself go to a
feature cache (:class:`~draftheads.training.features.FeatureShardWriter`), split into train/val by prompt
id, which ``train-head --data.feature_dir`` reads unchanged.

Progress goes to ``OUT.partial`` (plus ``OUT.partial.json``, the settings) and to the feature cache's
shards; a rerun of the same command resumes after the last committed shard, and ``OUT.partial`` is
renamed to ``OUT`` when everything is written, with the settings beside it (``OUT.settings.json``).

``extend`` grows a finished ``OUT`` (and its feature cache) with prompts added to the ones it answered:
with the other settings unchanged, only the new prompts are answered, and the cache gains shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from draftheads.datagen.batching import Conversation, Finished
from draftheads.errors import DraftheadsError
from draftheads.inference.sampling import SamplingParams
from draftheads.prompts import (
    RAW_TURN_SEP,
    Prompt,
    check_unique_ids,
    encode_chat,
    has_chat_template,
    render_chat,
)
from draftheads.targets import check_layer_ids, text_config
from draftheads.training.data import split_of
from draftheads.utils import (
    atomic_write_json,
    atomic_write_text,
    check_writable_dir,
    check_writable_file,
    exclusive,
    partial_paths,
    read_jsonl_prefix,
    refuse_changed_settings,
    stable_int,
)

_SENTINEL = "\u2063draftheads-answer\u2063"


def turn_segments(tokenizer, turns, eos_ids, name: str = "target") -> list[list[int]]:
    """Token ids of the first prompt, then of the template text that follows the end-of-turn token of
    each answer up to the next assistant turn (found by rendering a sentinel answer)."""
    segs = [encode_chat(tokenizer, [{"role": "user", "content": turns[0]}], name=name)]
    if len(turns) == 1:
        return segs
    if not has_chat_template(tokenizer):  # raw text: a later turn follows the answer after a blank line
        return segs + [tokenizer(RAW_TURN_SEP + t, add_special_tokens=False).input_ids for t in turns[1:]]
    closers = [tokenizer.decode([e]) for e in eos_ids]
    for k in range(1, len(turns)):
        msgs = []
        for q in turns[:k]:
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": _SENTINEL}]
        msgs.append({"role": "user", "content": turns[k]})
        text = render_chat(tokenizer, msgs, name=name)
        found = [(text.rfind(_SENTINEL + c), c) for c in closers if c and _SENTINEL + c in text]
        if not found:
            raise DraftheadsError(
                f"the chat template of {name} does not close an assistant turn with its end-of-turn token, "
                "so later turns cannot follow the target's own answers: give single-turn prompts"
            )
        at, closer = max(found)
        segs.append(tokenizer(text[at + len(_SENTINEL + closer):], add_special_tokens=False).input_ids)
    return segs


def _prompts_digest(prompts: list[Prompt]) -> str:
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([p.id, p.domain, list(p.turns)]).encode())
    return h.hexdigest()[:16]


def check_distill(prompts: list[Prompt], out, batch_size: int, features, feature_dir, val_fraction: float,
                  extend: bool = False) -> None:
    """The arguments of :func:`distill` that need no target, checked before it is loaded."""
    if batch_size < 1:
        raise DraftheadsError(f"--batch-size {batch_size} must be >= 1")
    if not 0 <= val_fraction <= 1:
        raise DraftheadsError(f"--val-fraction {val_fraction} must be in [0, 1] (1: all of it for validation)")
    if not prompts:
        raise DraftheadsError("no prompts to distill: check --prompts and --domains")
    check_unique_ids(prompts)
    if (features is None) != (feature_dir is None):
        raise DraftheadsError("--features and --feature-dir go together: give both, or neither")
    out = Path(out)
    if out.exists() and not extend:
        raise DraftheadsError(f"--out {str(out)!r} already exists: remove it, choose another path, or give --extend "
                              "to answer only the prompts it lacks")
    check_writable_file(out)
    if feature_dir is not None:
        check_writable_dir(feature_dir, "--feature-dir")


def distill(
    target, prompts: list[Prompt], out: str | os.PathLike, max_new_tokens: int = 256, temperature: float = 0.0,
    batch_size: int = 32, seed: int = 0, top_p: float = 1.0, top_k: int = 0, max_seq_len: int | None = None,
    features=None, feature_dir: str | os.PathLike | None = None, val_fraction: float = 0.05,
    shard_rows: int = 64, feature_dtype=torch.bfloat16, progress=print, engine: str = "draftheads",
    vllm: dict | None = None, extend: bool = False,
) -> Path:
    """Answer ``prompts`` with the target; returns ``out``. See the module docstring.

    ``engine``: ``draftheads`` (``target`` a loaded Target) or ``vllm`` (``target`` the target spec: only its
    tokenizer loads here; ``vllm`` holds :class:`~draftheads.datagen.backends.VLLMBackend` options such as
    ``python``, ``dtype``, ``tensor_parallel_size``, ``data_parallel_size``)."""
    from draftheads.datagen.backends import check_engine, make_backend

    SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens, seed=seed)
    check_engine(engine)
    check_distill(prompts, out, batch_size, features, feature_dir, val_fraction, extend)
    out = Path(out)
    with exclusive(out), (exclusive(feature_dir, "--feature-dir") if feature_dir is not None else nullcontext()):
        if out.exists() and not extend:  # a run that held the lock finished meanwhile
            raise DraftheadsError(f"--out {str(out)!r} was just written by another run: choose another path")
        layers = ()
        if features is not None:
            num_layers = target.info.num_layers if engine != "vllm" else text_config(str(target)).num_hidden_layers
            layers = check_layer_ids(features, num_layers, "--features")
            if not layers:
                raise DraftheadsError("--features names no layer: give ids like 2,15,27,30, or eagle3")
        backend, tok, name, dtype = make_backend(engine, target, out, batch_size, max_seq_len, seed, vllm,
                                                 capture=layers, feature_dtype=feature_dtype)
        try:
            return _distill(backend, tok, name, dtype, engine, prompts, out, max_new_tokens, temperature, batch_size,
                            seed, top_p, top_k, features, feature_dir, val_fraction, shard_rows, feature_dtype,
                            progress, extend)
        finally:
            backend.close()


def _distill(backend, tok, name, dtype, engine, prompts, out: Path, max_new_tokens, temperature, batch_size, seed,
             top_p, top_k, features, feature_dir, val_fraction, shard_rows, feature_dtype, progress,
             extend=False) -> Path:
    layers = tuple(getattr(backend, "capture", ()))
    settings = {"target": name, "prompts": _prompts_digest(prompts), "max_new_tokens": max_new_tokens,
                "temperature": temperature, "top_p": top_p, "seed": seed, "max_seq_len": backend.max_seq_len,
                "dtype": dtype, "val_fraction": val_fraction}
    if engine != "draftheads":
        settings["engine"] = engine  # a resume keeps its engine (older partial files name none: the project's)
    if top_k:
        settings["top_k"] = top_k  # likewise: older partial files sampled from the whole vocabulary
    partial, meta = partial_paths(out)
    if extend and out.exists():
        _reopen(out, settings, prompts, feature_dir if layers else None)
    if meta.is_file():
        refuse_changed_settings(json.loads(meta.read_text()), settings, partial)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(meta, settings)

    writer = None
    if layers:
        from draftheads.training.features import FeatureShardWriter

        writer = FeatureShardWriter(feature_dir, name, layers, backend.hidden_size, backend.max_seq_len,
                                    shard_rows, feature_dtype, settings)
        done = writer.done_keys
        kept = [r for r in read_jsonl_prefix(partial) if r["id"] in done]
    else:
        kept = read_jsonl_prefix(partial)
        done = {r["id"] for r in kept}
    atomic_write_text(partial, "".join(json.dumps(r) + "\n" for r in kept))

    by_id = {p.id: p for p in prompts}
    todo = [p for p in prompts if p.id not in done]
    eos = sorted(backend.eos)

    def conversations():
        for p in todo:
            segs = turn_segments(tok, p.turns, eos, name)
            sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                                seed=(seed + stable_int(p.id)) % (1 << 31))
            yield Conversation(p.id, segs, sp)

    waiting: dict[str, dict] = {}
    t0, last_note, n_done = time.perf_counter(), 0.0, len(done)
    with partial.open("a", encoding="utf-8") as f:

        def write(keys):
            for k in keys:
                f.write(json.dumps(waiting.pop(k)) + "\n")
            f.flush()
            os.fsync(f.fileno())

        for fin in backend.run(conversations()):
            waiting[fin.key] = _record(by_id[fin.key], fin, tok)
            n_done += 1
            if writer is not None:
                writer.add(split_of(fin.key, val_fraction, seed), fin.key, fin.token_ids, fin.loss_mask,
                           fin.features, fin.target_argmax)
                writer.commit(before_index=write)
            elif len(waiting) >= batch_size:
                write(list(waiting))
            now = time.perf_counter()
            if now - last_note > 10:
                last_note = now
                progress(f"distill: {n_done}/{len(prompts)} prompts, {backend.tokens_generated} new tokens, "
                         f"{backend.tokens_generated / (now - t0):.1f} tok/s")
        if writer is not None:
            writer.commit(final=True, before_index=write)
        write(list(waiting))
    dt = time.perf_counter() - t0
    progress(f"distill: {len(prompts)} prompts done; {backend.tokens_generated} new tokens in {dt:.0f} s "
             f"({backend.tokens_generated / max(dt, 1e-9):.1f} tok/s, batch {batch_size}, engine {engine})")
    if not backend.captures_features:
        progress(f"distill: engine {engine} wrote the text only; for features run "
                 f"`draftheads cache-features --data {out} --layers eagle3 --out FEATURE_DIR` (or train online)")
    os.replace(partial, out)
    os.replace(meta, settings_file(out))
    return out


def settings_file(out: Path) -> Path:
    """Where a finished distill keeps the settings it ran with (what ``extend`` must match)."""
    return out.with_name(out.name + ".settings.json")


def _reopen(out: Path, settings: dict, prompts: list[Prompt], feature_dir) -> None:
    """Turn the finished ``out`` (and its feature cache) back into an interrupted run over ``prompts``, so
    the resume answers only the prompts it lacks. Crash-safe: until ``out`` is renamed, a rerun starts
    this over."""
    idx = Path(feature_dir) / "index.json" if feature_dir is not None else None
    if settings_file(out).is_file():
        old = json.loads(settings_file(out).read_text())
    elif idx is not None and idx.is_file():  # outputs from before the settings were kept beside them
        old = json.loads(idx.read_text())["settings"]
    else:
        raise DraftheadsError(f"{out} has no {settings_file(out).name}, so its settings are unknown: it cannot be "
                              "extended; distill to a new --out")
    refuse_changed_settings({**old, "prompts": settings["prompts"]}, settings, out, action="extend")
    by_id = {p.id: p for p in prompts}
    for r in read_jsonl_prefix(out):
        p = by_id.get(r["id"])
        if p is None or list(p.turns[: len(r["turns"])]) != r["turns"]:
            raise DraftheadsError(
                f"{out} answers prompt {r['id']!r}, which --prompts {'changed' if p else 'lacks'}: --extend needs "
                "every prompt it was made from, unchanged, plus the new ones"
            )
    partial, meta = partial_paths(out)
    atomic_write_json(meta, settings)
    if idx is not None:
        if not idx.is_file():
            raise DraftheadsError(f"--feature-dir {str(feature_dir)!r} has no index.json: give the cache {out} was "
                                  "distilled with")
        index = json.loads(idx.read_text())
        if index.get("settings") not in (old, settings):  # settings: a rerun after a crash below
            raise DraftheadsError(f"--feature-dir {str(feature_dir)!r} was not written with {out}: give the cache "
                                  "it was distilled with")
        atomic_write_json(idx, {**index, "settings": settings, "complete": False})
    os.replace(out, partial)
    settings_file(out).unlink(missing_ok=True)


def _record(p: Prompt, fin: Finished, tokenizer) -> dict:
    answers = [tokenizer.decode(a, skip_special_tokens=True) for a in fin.answers]
    return {"id": p.id, "domain": p.domain, "turns": list(p.turns[: len(answers)]), "answers": answers,
            "truncated": fin.truncated}
