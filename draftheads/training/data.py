"""Training data: conversations -> chat-template tokens with an assistant-only loss mask -> packed rows.

Accepted jsonl records (one per line; forms may be mixed):

* OpenAI: ``{"messages": [{"role", "content"}, ...]}``
* ShareGPT: ``{"conversations": [{"from": "human"|"gpt"|"system", "value"}, ...]}``
* project prompts with answers: ``{"id", "domain", "turns": [...], "answers": [...]}`` (what
  ``draftheads distill`` writes)
* plain text: ``{"text": "..."}`` (every token is trained on)

The loss mask marks assistant tokens (content and end-of-turn token). Templates with generation tags
use ``return_assistant_tokens_mask``; others use prefix rendering: an assistant turn spans from the
end of ``render(messages[:i], add_generation_prompt=True)`` to the end of ``render(messages[:i+1])``
(trailing whitespace excluded).

Packed rows carry ``input_ids``, ``loss_mask``, ``position_ids`` (restarting per document) and
``doc_ids`` (-1 on padding); :func:`doc_causal_mask` turns them into the additive 4D attention mask.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from draftheads.errors import DraftheadsError
from draftheads.prompts import has_chat_template, render_chat
from draftheads.utils import cache_dir, file_sha256, read_utf8, stable_int

log = logging.getLogger(__name__)

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}


# ----------------------------------------------------------------------------- reading records


def record_to_messages(obj: dict, where: str) -> list[dict] | str:
    """A list of chat messages, or a plain string for text records."""
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
            raise DraftheadsError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        return [{"role": m["role"], "content": m["content"]} for m in msgs]
    if "conversations" in obj:
        out = []
        for m in obj["conversations"]:
            role = _SHAREGPT_ROLES.get(str(m.get("from", "")).lower())
            if role is None or "value" not in m:
                raise DraftheadsError(
                    f"{where}: ShareGPT turn {m!r} needs 'from' (human/gpt/system) and 'value'"
                )
            out.append({"role": role, "content": m["value"]})
        return out
    if "turns" in obj:
        answers = obj.get("answers")
        if not answers:
            raise DraftheadsError(
                f"{where}: prompt record {obj.get('id')!r} has no 'answers': generate them with "
                "`draftheads distill --prompts FILE --out FILE` and train on its output"
            )
        cut = obj.get("truncated") or [False] * len(answers)
        if any(cut[:-1]):
            raise DraftheadsError(
                f"{where}: only the last answer may be truncated (a conversation stops at a truncated answer)"
            )
        out = []
        for q, a, c in zip(obj["turns"], answers, cut):
            out += [{"role": "user", "content": q}, {"role": "assistant", "content": a, **({"truncated": True} if c else {})}]
        return out
    if "text" in obj:
        if not isinstance(obj["text"], str):
            raise DraftheadsError(f"{where}: 'text' must be a string")
        return obj["text"]
    raise DraftheadsError(
        f"{where}: fields {sorted(obj)} match no training form: use 'messages' (OpenAI), "
        "'conversations' (ShareGPT), 'turns' + 'answers' (draftheads distill) or 'text'"
    )


def split_of(key: str, val_fraction: float, seed: int) -> str:
    """``val`` for a stable ``val_fraction`` of conversation keys, else ``train``: a key keeps its split
    whatever else the data holds, so a grown dataset never moves a trained conversation into validation."""
    return "val" if stable_int(f"{seed}:{key}") % 100_000 < val_fraction * 100_000 else "train"


def record_key(obj: dict, messages: list[dict] | str) -> str:
    """What decides a conversation's split: its ``id`` where it has one (the prompt id ``distill`` writes,
    so its own feature capture splits alike), else its prompt (every turn before the first answer) or text."""
    if isinstance(obj.get("id"), (str, int)):
        return str(obj["id"])
    if isinstance(messages, str):
        return messages
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    return json.dumps([[m["role"], m["content"]] for m in messages[:first]], ensure_ascii=False)


def read_records(path: str | os.PathLike) -> list[tuple[str, list[dict] | str]]:
    """(:func:`record_key`, conversation) for each record of a jsonl file."""
    path = Path(path)
    if not path.is_file():
        raise DraftheadsError(f"training file {str(path)!r} does not exist: check data.train_files")
    text = read_utf8(path, "training file")
    out = []
    for n, line in enumerate(text.split("\n"), 1):
        if line.strip():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DraftheadsError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            messages = record_to_messages(obj, f"{path}:{n}")
            out.append((record_key(obj, messages), messages))
    if not out:
        raise DraftheadsError(f"training file {str(path)!r} is empty: it needs one conversation per line")
    return out


# ----------------------------------------------------------------------------- tokenising


def has_generation_tags(tokenizer) -> bool:
    tpl = getattr(tokenizer, "chat_template", None) or ""
    return "{% generation %}" in tpl or "{%- generation %}" in tpl


def tokenize_conversation(tokenizer, messages, use_generation_tags: bool | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) for one conversation or plain text. A last assistant message marked
    ``truncated`` ends after its content: no end-of-turn token is added that the target did not write."""
    if isinstance(messages, str):
        ids = tokenizer(messages, add_special_tokens=True).input_ids
        return ids, [1] * len(ids)
    cut = bool(messages) and messages[-1].get("truncated", False)
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if use_generation_tags is None:
        use_generation_tags = has_generation_tags(tokenizer)
    if use_generation_tags and not cut:
        enc = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(enc["input_ids"]), list(enc["assistant_masks"])
    if cut:
        full = render_chat(tokenizer, messages[:-1], add_generation_prompt=True) + messages[-1]["content"]
    else:
        full = render_chat(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = render_chat(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        if cut and i == len(messages) - 1:
            upto = full
        else:
            upto = render_chat(tokenizer, messages[: i + 1], add_generation_prompt=False).rstrip()
        if not full.startswith(prefix) or not full.startswith(upto):
            raise DraftheadsError(
                "the chat template renders earlier turns differently once later turns are added, so the "
                "assistant mask cannot be found by prefix rendering: use a template with {% generation %} tags"
            )
        spans.append((len(prefix), len(upto)))
    enc = tokenizer(full, add_special_tokens=not has_chat_template(tokenizer), return_offsets_mapping=True)
    mask = [int(any(s <= a and b <= e and b > a for s, e in spans)) for a, b in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


# ----------------------------------------------------------------------------- packing


@dataclass
class PackStats:
    samples: int = 0
    truncated: int = 0
    dropped_no_assistant: int = 0
    rows: int = 0
    assistant_tokens: int = 0
    tokens: int = 0


def pack(samples, max_length: int, pad_id: int, packed: bool = True) -> tuple[list[dict], PackStats]:
    """Greedy packing of (ids, mask) samples into rows of ``max_length`` (or one sample per row)."""
    stats = PackStats()
    rows: list[dict] = []
    cur = {"input_ids": [], "loss_mask": [], "position_ids": [], "doc_ids": []}
    doc = 0

    def flush():
        nonlocal cur, doc
        if cur["input_ids"]:
            n = max_length - len(cur["input_ids"]) if packed else 0
            cur["input_ids"] += [pad_id] * n
            cur["loss_mask"] += [0] * n
            cur["position_ids"] += [0] * n
            cur["doc_ids"] += [-1] * n
            rows.append(cur)
        cur = {"input_ids": [], "loss_mask": [], "position_ids": [], "doc_ids": []}
        doc = 0

    for ids, mask in samples:
        stats.samples += 1
        if len(ids) > max_length:
            stats.truncated += 1
            ids, mask = ids[:max_length], mask[:max_length]
        if sum(mask) == 0:
            stats.dropped_no_assistant += 1
            continue
        if not packed or len(cur["input_ids"]) + len(ids) > max_length:
            flush()
        cur["input_ids"] += ids
        cur["loss_mask"] += mask
        cur["position_ids"] += list(range(len(ids)))
        cur["doc_ids"] += [doc] * len(ids)
        doc += 1
        stats.assistant_tokens += sum(mask)
        stats.tokens += len(ids)
    flush()
    stats.rows = len(rows)
    return rows, stats


def collate(rows: list[dict], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Stack rows, right-padding to the longest (packed rows are already equal length)."""
    n = max(len(r["input_ids"]) for r in rows)
    fill = {"input_ids": pad_id, "loss_mask": 0, "position_ids": 0, "doc_ids": -1}
    return {
        k: torch.tensor([list(r[k]) + [v] * (n - len(r[k])) for r in rows], dtype=torch.long)
        for k, v in fill.items()
    }


def doc_causal_mask(doc_ids: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Additive [B, 1, T, T] mask: causal within a document; padding rows attend to themselves only."""
    b, t = doc_ids.shape
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    allowed = causal & same
    allowed |= torch.eye(t, dtype=torch.bool, device=doc_ids.device)  # keep padding rows finite
    mask = torch.zeros(b, 1, t, t, dtype=dtype, device=doc_ids.device)
    return mask.masked_fill(~allowed[:, None], torch.finfo(dtype).min)


def answer_window(loss_mask: torch.Tensor, doc_ids: torch.Tensor, n: int) -> torch.Tensor:
    """[B, T] loss mask keeping the first ``n`` tokens of each answer (a run of loss-mask tokens within
    one document): the part of an answer a ``--max-new-tokens n`` evaluation sees."""
    m = loss_mask.bool()
    cont = torch.zeros_like(m)
    cont[:, 1:] = m[:, :-1] & (doc_ids[:, 1:] == doc_ids[:, :-1])
    idx = torch.arange(m.shape[1], device=m.device).expand_as(m)
    start = torch.where(m & ~cont, idx, torch.zeros_like(idx)).cummax(1).values  # this answer's first token
    return (m & (idx - start < n)).to(loss_mask.dtype)


# ----------------------------------------------------------------------------- building a dataset


def _dataset(rows: list[dict]):
    """Packed rows as a ``datasets.Dataset`` (the row columns even when there are none)."""
    import datasets

    if rows:
        return datasets.Dataset.from_list(rows)
    return datasets.Dataset.from_dict({"input_ids": [], "loss_mask": [], "position_ids": [], "doc_ids": []})


def build_dataset(
    tokenizer,
    files,
    max_length: int,
    packed: bool = True,
    val_fraction: float = 0.05,
    seed: int = 0,
    cache: bool = True,
    tokenizer_key: str = "",
):
    """Tokenise, split (by conversation, :func:`split_of` of each :func:`record_key`) and pack; returns
    (train, val) ``datasets.Dataset`` and stats. At least one conversation is held out when ``val_fraction``
    is above 0 and there are two or more; ``val_fraction`` 1 holds out all of them (a held-out set to
    validate heads on, e.g. ``cache-features --val-fraction 1``).

    Results are cached as Arrow under ``$XDG_CACHE_HOME/draftheads/data/<key>``.
    """
    import datasets

    if not files:
        raise DraftheadsError("data.train_files is empty: give at least one jsonl file")
    if not 0 <= val_fraction <= 1:
        raise DraftheadsError(f"data.val_fraction={val_fraction} must be in [0, 1] (1: all of it for validation)")
    key_src = json.dumps({
        "files": [file_sha256(f) if os.path.isfile(f) else str(f) for f in files],
        "tok": tokenizer_key or getattr(tokenizer, "name_or_path", ""), "vocab": len(tokenizer),
        "tpl": hashlib.sha256((getattr(tokenizer, "chat_template", "") or "").encode()).hexdigest(),
        "max_length": max_length, "packed": packed, "val": val_fraction, "seed": seed, "v": 3,
    }, sort_keys=True)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:20]
    where = cache_dir() / "data" / key
    if cache and (where / "stats.json").is_file():
        stats = json.loads((where / "stats.json").read_text())
        train, val = (datasets.load_from_disk(str(where / s)) if (where / s).is_dir() else _dataset([])
                      for s in ("train", "val"))
        return train, val, stats

    keyed = [r for f in files for r in read_records(f)]
    records = [messages for _, messages in keyed]
    val_idx = {i for i, (key, _) in enumerate(keyed) if split_of(key, val_fraction, seed) == "val"}
    if not val_idx and val_fraction > 0 and len({key for key, _ in keyed}) >= 2:
        first = min(keyed, key=lambda r: stable_int(f"{seed}:{r[0]}"))[0]
        val_idx = {i for i, (key, _) in enumerate(keyed) if key == first}
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(seed)).tolist()
    train_idx = [i for i in order if i not in val_idx]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    tagged = has_generation_tags(tokenizer)

    def rows_of(idx):
        return pack((tokenize_conversation(tokenizer, records[i], tagged) for i in idx), max_length, pad_id, packed)

    train_rows, train_stats = rows_of(train_idx)
    val_rows, val_stats = rows_of(sorted(val_idx))
    if train_stats.assistant_tokens + val_stats.assistant_tokens == 0:
        raise DraftheadsError(
            f"training data {list(map(str, files))} has zero assistant tokens after masking: "
            "check that conversations contain assistant turns (or use 'text' records)"
        )
    stats = {"train": train_stats.__dict__, "val": val_stats.__dict__, "masking": "generation tags" if tagged else "prefix rendering"}
    if train_stats.truncated or val_stats.truncated:
        log.warning("%d samples longer than max_length=%d were truncated", train_stats.truncated + val_stats.truncated, max_length)
    train, val = _dataset(train_rows), _dataset(val_rows)
    if cache:
        from draftheads.utils import atomic_dir

        with atomic_dir(where, "dataset cache", overwrite=True) as tmp:
            for name, split in (("train", train), ("val", val)):
                if len(split):  # datasets cannot load back a split of no rows: its absence stands for one
                    split.save_to_disk(str(tmp / name))
            (tmp / "stats.json").write_text(json.dumps(stats))
    return train, val, stats
