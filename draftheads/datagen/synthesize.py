"""Prompts written by the target itself, for targets without a dataset (Magpie, arXiv 2406.08464).

An aligned chat model sampled right after its template's user prefix writes a user request. Each
domain steers it with an opening of the request (the project's own text, below); summarization and
translation prompts wrap a passage the target wrote itself in an instruction; a fraction of prompts
gets a follow-up turn the target writes after its own answer.

Candidates are filtered (finished, length, looks like a request), deduplicated exactly and by MinHash
LSH (``datasketch``) against everything kept so far, and appended to ``OUT.partial`` one round at a
time, so a rerun of the same command resumes. The output is the project's prompt jsonl
(``{"id", "domain", "turns"}``), plus ``OUT.stats.json`` with per-domain counts, rejection reasons and
diversity (distinct n-grams, near-duplicate rate). ``extend`` grows a finished ``OUT`` to a larger
``num_prompts`` with its other settings unchanged: its prompts are kept, new rounds are deduplicated
against them, and ids go on where they stopped.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from draftheads.datagen.batching import Conversation
from draftheads.errors import DraftheadsError
from draftheads.inference.sampling import SamplingParams
from draftheads.prompts import has_chat_template, render_chat
from draftheads.utils import (
    atomic_write_json,
    atomic_write_text,
    exclusive,
    partial_paths,
    read_jsonl_prefix,
    refuse_changed_settings,
)

# Openings of the user turn per domain ("" = unsteered). Passage requests feed summarization and
# translation, whose prompts wrap the target's own passage in an instruction.
OPENERS = {
    "chat": ["", "", "Can you", "I need some advice", "What do you think", "Help me", "I'm trying to", "Tell me",
             "Write a short story", "Give me some ideas", "Write an email", "Write a poem"],
    "code": ["Write a Python function", "How do I", "Write a JavaScript function", "Explain what this code does",
             "What is the difference between", "Write a SQL query", "How can I fix", "Implement a",
             "Write a Python program", "What does this Python code", "Write a bash script", "Can you explain how"],
    "math": ["Solve", "A store sells", "If a train", "Calculate", "What is the sum of", "John has", "Find the value of",
             "A rectangle has", "Sarah bought", "How many", "What is 15% of", "A recipe calls for"],
    "qa": ["What is", "Who was", "Why do", "How does", "When did", "Where is", "What are the main", "Why is",
           "What causes", "How did", "Which", "What happens when"],
}
PASSAGE_OPENERS = ["Write a short article about", "Write a paragraph about", "Describe", "Write a short essay on",
                   "Write a news story about", "Explain in a few paragraphs"]
SUMMARY_TEMPLATES = [
    "Summarize the following text in two sentences.\n\n{p}",
    "{p}\n\nSummarize the passage above.",
    "Give a one-sentence summary of this text:\n\n{p}",
    "What is the main point of the following passage?\n\n{p}",
    "Summarize this article in a few bullet points:\n\n{p}",
    "{p}\n\nWrite a short summary of the text above for a busy reader.",
]
TRANSLATION_TEMPLATES = [
    "Translate the following sentence into {lang}: {s}",
    "Translate into {lang}:\n\n{s}",
    "How do you say this in {lang}? \"{s}\"",
    "Please translate this text to {lang}.\n\n{s}",
]
LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Chinese", "Japanese", "Russian"]
MULTI_TURN_DOMAINS = ("chat", "code", "qa", "math")
SYNTH_DOMAINS = ("chat", "code", "math", "summarization", "translation", "qa")

_REQUEST_STARTS = {
    "write", "explain", "describe", "how", "what", "why", "who", "when", "where", "which", "can", "could", "would",
    "should", "is", "are", "do", "does", "did", "give", "list", "create", "tell", "help", "make", "find", "solve",
    "calculate", "compute", "implement", "translate", "summarize", "compare", "suggest", "i", "i'm", "please",
    "generate", "design", "provide", "name", "show", "fix", "convert", "if", "a", "an", "john", "sarah", "let's",
    "imagine", "discuss", "analyze", "rewrite", "edit", "recommend", "define", "determine", "evaluate", "identify",
}
_ANSWER_STARTS = ("sure", "certainly", "of course", "i'm sorry", "i am sorry", "as an ai", "here is", "here's",
                  "thank you", "thanks", "absolutely", "great question", "hello! i", "i am smollm", "i'm smollm")
_SPECIAL = re.compile(r"<\|[a-z_]+\|>")


def _whole_sentences(text: str) -> str:
    """``text`` up to its last sentence end (``.``, ``!`` or ``?``); empty if it has none."""
    ends = [m.end() for m in re.finditer(r"[.!?](?=\s|$)", text)]
    return text[: ends[-1]] if ends else ""


def is_request(text: str) -> bool:
    """A user turn that asks for something (question or instruction), not an answer or chatter."""
    low = text.strip().lower()
    if low.startswith(_ANSWER_STARTS):
        return False
    first = re.split(r"[\s,.:;!]", low, maxsplit=1)[0]
    return "?" in text or first in _REQUEST_STARTS


def distinct_n(texts: list[str], n: int) -> float:
    """Distinct n-grams / all n-grams over ``texts`` (word level)."""
    grams, total = set(), 0
    for t in texts:
        w = t.lower().split()
        g = [tuple(w[i: i + n]) for i in range(len(w) - n + 1)]
        grams.update(g)
        total += len(g)
    return len(grams) / total if total else 0.0


def _shingles(text: str) -> set[bytes]:
    w = re.findall(r"\w+", text.lower())
    if len(w) < 3:
        return {" ".join(w).encode()}
    return {" ".join(w[i: i + 3]).encode() for i in range(len(w) - 2)}


class Deduper:
    """Exact (normalised text) and near-duplicate (MinHash LSH on word 3-grams) detection."""

    def __init__(self, threshold: float = 0.7, num_perm: int = 128):
        try:
            from datasketch import MinHash, MinHashLSH
        except ImportError:  # pragma: no cover - a dependency of the package
            raise DraftheadsError("synthesize needs datasketch: pip install datasketch") from None
        self._minhash = lambda: MinHash(num_perm=num_perm, seed=1)
        self.lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
        self.exact: set[str] = set()
        self._n = 0

    def check(self, text: str) -> str | None:
        """``None`` and remember ``text`` if it is new; else ``"exact_dup"`` or ``"near_dup"``."""
        norm = " ".join(text.lower().split())
        if norm in self.exact:
            return "exact_dup"
        m = self._minhash()
        for s in _shingles(text):
            m.update(s)
        if self.lsh.query(m):
            return "near_dup"
        self.exact.add(norm)
        self.lsh.insert(str(self._n), m)
        self._n += 1
        return None


@dataclass
class SynthConfig:
    num_prompts: int = 600
    """Prompts to keep in all, shared equally by ``domains``."""
    domains: tuple[str, ...] = SYNTH_DOMAINS
    multi_turn: float = 0.15
    """Fraction of chat/code/qa/math prompts that get a follow-up turn."""
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 0
    max_prompt_tokens: int = 160
    """Longest user turn written (longer candidates are unfinished and dropped)."""
    passage_tokens: int = 120
    answer_tokens: int = 256
    """Answer length before a follow-up turn is written."""
    min_words: int = 4
    round_size: int = 192
    """Candidates per round (a round is the unit of resume)."""
    batch_size: int = 64
    dedup_threshold: float = 0.7
    seed: int = 0

    def __post_init__(self):
        unknown = set(self.domains) - set(SYNTH_DOMAINS)
        if unknown or not self.domains:
            raise DraftheadsError(f"--domains {sorted(unknown) or '[]'}: use some of {list(SYNTH_DOMAINS)}")
        if self.num_prompts < 1:
            raise DraftheadsError(f"--num-prompts {self.num_prompts} must be >= 1")
        if not 0 <= self.multi_turn <= 1:
            raise DraftheadsError(f"--multi-turn {self.multi_turn} must be in [0, 1]")
        if self.round_size < 1 or self.batch_size < 1:
            raise DraftheadsError("--round-size and --batch-size must be >= 1")
        if not 0 < self.dedup_threshold <= 1:
            raise DraftheadsError(f"--dedup-threshold {self.dedup_threshold} must be in (0, 1]")
        SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                       max_new_tokens=self.max_prompt_tokens)


@dataclass
class _Stats:
    candidates: Counter = field(default_factory=Counter)
    kept: Counter = field(default_factory=Counter)
    rejected: dict = field(default_factory=dict)

    def reject(self, domain: str, why: str) -> None:
        self.rejected.setdefault(domain, Counter())[why] += 1


def user_prefix(tokenizer, history: list[dict], name: str = "target") -> str:
    """The rendered conversation up to where a new user turn's text begins."""
    sentinel = "\u2063draftheads-user\u2063"
    text = render_chat(tokenizer, history + [{"role": "user", "content": sentinel}], add_generation_prompt=False,
                       name=name)
    return text[: text.index(sentinel)]


class Synthesizer:
    def __init__(self, backend, tokenizer, name: str, config: SynthConfig):
        """``backend``: the engine writing the text (:mod:`draftheads.datagen.backends`)."""
        self.backend, self.tok, self.name, self.cfg = backend, tokenizer, name, config
        if not has_chat_template(tokenizer):
            raise DraftheadsError(f"synthesize: the tokenizer of {name} has no chat template (a base model), so it "
                                  "cannot be asked to write prompts: give distill prompt files of your own instead")

    def _generate(self, texts: list[str], max_new: list[int], seed: int, temperature=None) -> list[tuple[str, bool]]:
        """(continuation, finished) per rendered text, each with its own token budget, in one batched run."""
        t = self.cfg.temperature if temperature is None else temperature
        convs = [Conversation(i, [self.tok(x, add_special_tokens=False).input_ids],
                              SamplingParams(temperature=t, top_p=self.cfg.top_p, top_k=self.cfg.top_k,
                                             max_new_tokens=n, seed=seed + i))
                 for i, (x, n) in enumerate(zip(texts, max_new))]
        out: dict[int, tuple[str, bool]] = {}
        for f in self.backend.run(convs):
            out[f.key] = (self.tok.decode(f.answers[0], skip_special_tokens=True), not f.truncated[0])
        return [out[i] for i in range(len(texts))]

    def _user_turns(self, prefixes: list[str], openers: list[str], seed: int) -> list[tuple[str, bool]]:
        cont = self._generate([p + o for p, o in zip(prefixes, openers)], [self.cfg.max_prompt_tokens] * len(openers),
                              seed)
        return [((o + c).strip(), done) for o, (c, done) in zip(openers, cont)]

    def round(self, r: int, wanted: dict[str, int]) -> list[dict]:
        """Candidates of round ``r`` for domains still short of their quota: [{domain, turns, finished}]."""
        cfg, name = self.cfg, self.name
        rng = random.Random(cfg.seed * 1_000_003 + r)
        seed = (cfg.seed * 1_000_003 + r * 10_007) % (1 << 30)
        live = [d for d in cfg.domains if wanted[d] > 0]
        plan = [live[i % len(live)] for i in range(cfg.round_size)]
        base = user_prefix(self.tok, [], name)
        # phase 1: user turns (direct domains) and passage requests (summarization, translation)
        openers = [rng.choice(OPENERS[d]) if d in OPENERS else rng.choice(PASSAGE_OPENERS) for d in plan]
        first = self._user_turns([base] * len(plan), openers, seed)
        cands = [{"domain": d, "turns": [t], "finished": ok} for d, (t, ok) in zip(plan, first)]
        # phase 2: passages, and answers of the prompts that get a follow-up
        wrap = [c for c in cands if c["domain"] not in OPENERS and c["finished"]]
        multi = [c for c in cands if c["domain"] in MULTI_TURN_DOMAINS and c["finished"] and is_request(c["turns"][0])
                 and rng.random() < cfg.multi_turn]
        jobs = [(c, cfg.passage_tokens) for c in wrap] + [(c, cfg.answer_tokens) for c in multi]
        texts = [render_chat(self.tok, [{"role": "user", "content": c["turns"][0]}], name=name) for c, _ in jobs]
        answers = self._generate(texts, [n for _, n in jobs], seed + 50_000, temperature=0.0)
        for (c, _), (text, ok) in zip(jobs, answers):
            if c in wrap:  # a passage cut at its budget still serves, up to its last full sentence
                passage = text if ok else _whole_sentences(text)
                wrapped = self._wrap(c["domain"], passage, rng) if passage.strip() else ""
                c["turns"], c["finished"] = [wrapped], bool(wrapped)
            else:
                c["answer"] = text if ok else None
        # phase 3: follow-up user turns after the target's own answer
        follow = [c for c in multi if c.get("answer")]
        prefixes = [user_prefix(self.tok, [{"role": "user", "content": c["turns"][0]},
                                           {"role": "assistant", "content": c["answer"]}], name) for c in follow]
        for c, (t, ok) in zip(follow, self._user_turns(prefixes, [""] * len(follow), seed + 90_000)):
            if ok and len(t.split()) >= cfg.min_words and is_request(t):
                c["turns"].append(t)
        for c in cands:
            c.pop("answer", None)
        return cands

    @staticmethod
    def _wrap(domain: str, passage: str, rng: random.Random) -> str:
        passage = passage.strip()
        if domain == "summarization":
            return rng.choice(SUMMARY_TEMPLATES).format(p=passage)
        sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", passage) if 5 <= len(s.split()) <= 40]
        if not sentences:
            return ""
        k = rng.randint(0, len(sentences) - 1)
        text = " ".join(sentences[k: k + rng.choice((1, 1, 2))])
        return rng.choice(TRANSLATION_TEMPLATES).format(lang=rng.choice(LANGUAGES), s=text)


def synthesize(target, out: str | os.PathLike, config: SynthConfig | None = None, progress=print,
               engine: str = "draftheads", vllm: dict | None = None, extend: bool = False) -> Path:
    """Write ``config.num_prompts`` target-written prompts to ``out``; see the module docstring. One run
    at a time writes ``out`` (a second stops with one line). ``engine``/``vllm``: who writes the text, as
    for :func:`~draftheads.datagen.distill.distill` (``target`` is the spec for ``vllm``). ``extend``: grow
    an existing ``out`` to ``config.num_prompts`` (without one, it is written from nothing)."""
    from draftheads.datagen.backends import make_backend

    out = Path(out)
    cfg = config or SynthConfig()
    with exclusive(out):
        if out.exists() and not extend:
            raise DraftheadsError(f"--out {str(out)!r} already exists: remove it, choose another path, or give "
                                  "--extend to grow it to --num-prompts")
        backend, tok, name, _ = make_backend(engine, target, out, cfg.batch_size, seed=cfg.seed, vllm=vllm)
        try:
            settings = _settings(cfg, name, engine)
            if out.exists():
                _reopen(out, settings)
            return _synthesize(backend, tok, name, out, cfg, settings, progress)
        finally:
            backend.close()


def _settings(cfg: SynthConfig, name: str, engine: str) -> dict:
    """What a resumed or extended run must share with the run it continues."""
    settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.__dict__.items()}
    settings["target"] = name
    if not cfg.top_k:
        del settings["top_k"]  # partial files from before top_k sampled from the whole vocabulary
    if engine != "draftheads":
        settings["engine"] = engine
    return settings


def _reopen(out: Path, settings: dict) -> None:
    """Turn the finished ``out`` back into an interrupted run aiming at ``settings["num_prompts"]``, so the
    resume below extends it. Crash-safe: until ``out`` is renamed, a rerun starts this over."""
    partial, meta = partial_paths(out)
    report_file = out.with_name(out.name + ".stats.json")
    if not report_file.is_file():
        raise DraftheadsError(f"{out} has no {report_file.name}, so its settings are unknown: it cannot be "
                              "extended; synthesize to a new --out")
    report = json.loads(report_file.read_text())
    if report["total"] > settings["num_prompts"]:
        raise DraftheadsError(f"--num-prompts {settings['num_prompts']} is below the {report['total']} prompts "
                              f"{out} holds: --extend only grows a file")
    refuse_changed_settings({**report["settings"], "num_prompts": settings["num_prompts"]}, settings, out, action="extend")
    domains = report["domains"]
    candidates = {d: v["candidates"] for d, v in domains.items()}
    # every round plans round_size candidates (files from before "rounds" was recorded)
    rounds = report.get("rounds", sum(candidates.values()) // settings["round_size"])
    atomic_write_json(meta, {"settings": settings, "round": rounds, "kept": report["total"], "stats": {
        "candidates": candidates, "kept": {d: v["kept"] for d, v in domains.items()},
        "rejected": {d: v["rejected"] for d, v in domains.items()}}})
    os.replace(out, partial)


def _synthesize(backend, tok, name: str, out: Path, cfg: SynthConfig, settings: dict, progress) -> Path:
    partial, meta = partial_paths(out)
    state = {"settings": settings, "round": 0, "stats": {}}
    if meta.is_file():
        state = json.loads(meta.read_text())
        refuse_changed_settings(state["settings"], settings, partial)
    synth = Synthesizer(backend, tok, name, cfg)
    dedup = Deduper(cfg.dedup_threshold)
    kept = read_jsonl_prefix(partial)
    kept = kept[: state.get("kept", len(kept))]  # lines past the last finished round are redone
    for rec in kept:
        dedup.check(rec["turns"][0])
    stats = _Stats(Counter(state["stats"].get("candidates", {})), Counter(state["stats"].get("kept", {})),
                   {d: Counter(v) for d, v in state["stats"].get("rejected", {}).items()})
    share = {d: cfg.num_prompts // len(cfg.domains) + (i < cfg.num_prompts % len(cfg.domains))
             for i, d in enumerate(cfg.domains)}
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(partial, "".join(json.dumps(r) + "\n" for r in kept))
    t0 = time.perf_counter()
    while True:
        have = Counter(r["domain"] for r in kept)
        wanted = {d: share[d] - have[d] for d in cfg.domains}
        if all(w <= 0 for w in wanted.values()):
            break
        r = state["round"]
        if r > 20 * (cfg.num_prompts // cfg.round_size + 1):
            raise DraftheadsError(
                f"synthesize kept {len(kept)} of {cfg.num_prompts} prompts after {r} rounds: the target rarely "
                "writes usable requests; raise --temperature or lower --num-prompts"
            )
        new = []
        for c in synth.round(r, wanted):
            d = c["domain"]
            stats.candidates[d] += 1
            why = _reject(c, cfg) or dedup.check(c["turns"][0])
            if why is None and have[d] + sum(1 for x in new if x["domain"] == d) >= share[d]:
                why = "quota_full"
            if why:
                stats.reject(d, why)
                continue
            stats.kept[d] += 1
            new.append({"id": f"syn-{d}-{stats.kept[d]:06d}", "domain": d, "turns": c["turns"]})
        with partial.open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(x) + "\n" for x in new)
            f.flush()
            os.fsync(f.fileno())
        kept += new
        state.update(round=r + 1, kept=len(kept), stats={"candidates": stats.candidates, "kept": stats.kept,
                                                          "rejected": stats.rejected})
        atomic_write_json(meta, state)
        progress(f"synthesize: round {r + 1}, kept {len(kept)}/{cfg.num_prompts} "
                 f"({time.perf_counter() - t0:.0f} s, {backend.tokens_generated} tokens written)")
    report = diversity_report(kept, stats)
    report["settings"], report["rounds"] = settings, state["round"]
    atomic_write_json(out.with_name(out.name + ".stats.json"), report)
    os.replace(partial, out)
    meta.unlink()
    return out


def _reject(c: dict, cfg: SynthConfig) -> str | None:
    text = c["turns"][0]
    if not c["finished"] or not text:
        return "unfinished"
    if _SPECIAL.search(text):
        return "template_tokens"
    if len(text.split()) < cfg.min_words:
        return "too_short"
    if c["domain"] in OPENERS and not is_request(text):
        return "not_a_request"
    return None


def diversity_report(records: list[dict], stats: _Stats) -> dict:
    """Per domain: candidates, kept, rejections by reason, distinct-1/2/3 and the near-duplicate rate."""
    out = {"domains": {}, "total": len(records)}
    for d in sorted({r["domain"] for r in records} | set(stats.candidates)):
        texts = [r["turns"][0] for r in records if r["domain"] == d]
        rej = dict(stats.rejected.get(d, {}))
        cand = stats.candidates[d]
        out["domains"][d] = {
            "candidates": cand, "kept": len(texts), "rejected": rej,
            "multi_turn": sum(1 for r in records if r["domain"] == d and len(r["turns"]) > 1),
            "near_dup_rate": round((rej.get("near_dup", 0) + rej.get("exact_dup", 0)) / cand, 4) if cand else 0.0,
            "distinct_1": round(distinct_n(texts, 1), 4), "distinct_2": round(distinct_n(texts, 2), 4),
            "distinct_3": round(distinct_n(texts, 3), 4),
            "mean_words": round(sum(len(t.split()) for t in texts) / max(len(texts), 1), 1),
            "sample": texts[:3],
        }
    return out


def markdown(report: dict) -> str:
    """The table of a ``synthesize`` run's ``OUT.stats.json``: per domain, what was kept of the candidates,
    why the others were rejected, and the diversity of what was kept."""
    s = report.get("settings", {})
    head = ", ".join(f"{k} {s[k]}" for k in ("target", "num_prompts", "temperature", "top_p", "max_prompt_tokens",
                                             "multi_turn", "dedup_threshold", "seed") if k in s)
    lines = [f"{report['total']} prompts kept ({head})" if head else f"{report['total']} prompts kept", "",
             "| domain | kept / candidates | rejected | near-dup rate | distinct-1 | distinct-2 | distinct-3 | "
             "mean words | multi-turn | a sample |", "|---|---|---|---|---|---|---|---|---|---|"]
    for d, v in report["domains"].items():
        why = ", ".join(f"{k} {n}" for k, n in sorted(v["rejected"].items(), key=lambda kv: -kv[1])) or "-"
        sample = " ".join(v["sample"][0].split()) if v["sample"] else ""
        sample = (sample if len(sample) <= 120 else sample[:117].rstrip() + "…").replace("|", "\\|")
        lines.append(f"| {d} | {v['kept']} / {v['candidates']} | {why} | {v['near_dup_rate']:.3f} | "
                     f"{v['distinct_1']:.3f} | {v['distinct_2']:.3f} | {v['distinct_3']:.3f} | {v['mean_words']:.1f} | "
                     f"{v['multi_turn']} | \"{sample}\" |")
    return "\n".join(lines) + "\n"
