"""Walked τ: the engine's drafting replayed along the target's own greedy text, with no target forward
per step.

At T = 0 the walk accepts a drafted node exactly when its token is the target's argmax after the path
to it, and along the target's greedy text that argmax is the text's next token. So, given each prompt's
greedy answer and the target's hidden states over prompt and answer (one forward per text), the engine's
own proposer drafts from every position the walk reaches, fed the committed features through ``start``
and ``observe`` as the engine feeds them, and each draft's accepted length is read off the text. The
counts are the engine's (:class:`~draftheads.metrics.SpecMetrics`: τ, α per position, per domain), at
the cost of the draft forwards alone, where the eval also runs the target twice per step (plain and
speculative) at batch 1.

What differs from the eval: the hidden states come from one forward over the whole text instead of one
per step (the same up to floating-point order), and the texts are decoded in batches (in fp32 the same
greedy text; in reduced precision near ties may flip with the batch shape). The ``auto`` mode is not
replayed: what it drafts depends on the step times.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from draftheads.inference.engine import Engine
from draftheads.inference.proposers.base import Proposer, RequestState
from draftheads.inference.sampling import SamplingParams
from draftheads.inference.tree import Tree, TreeSpec, depths
from draftheads.inference.verify import verify_greedy
from draftheads.metrics import SpecMetrics


@dataclass
class WalkText:
    """One turn to walk: its encoded prompt (history included) and the target's greedy answer, which
    may run a few tokens past ``limit`` (the answer length the eval counts) so the last draft is
    judged as the engine judges it."""

    prompt: list[int]
    answer: list[int]
    limit: int
    domain: str = ""


def greedy_texts(target, prompts, max_new_tokens: int, batch_size: int = 16, overhang: int = 8) -> list[WalkText]:
    """The target's greedy answer to every turn of ``prompts`` (:class:`~draftheads.prompts.Prompt`), with
    the history of earlier turns as the eval builds it, decoded ``batch_size`` rows at a time."""
    from draftheads.prompts import encode_chat

    tok = target.tokenizer
    engine = Engine(target.model, tok, None)
    params = SamplingParams(max_new_tokens=max_new_tokens + overhang)
    histories: dict[str, list[dict]] = {p.id: [] for p in prompts}
    out = []
    for turn in range(max((len(p.turns) for p in prompts), default=0)):
        live = [p for p in prompts if turn < len(p.turns)]
        for s in range(0, len(live), batch_size):
            batch = live[s: s + batch_size]
            for p in batch:
                histories[p.id].append({"role": "user", "content": p.turns[turn]})
            ids = [encode_chat(tok, histories[p.id], name=target.info.name) for p in batch]
            for p, prompt, o in zip(batch, ids, engine.generate(ids, params)):
                out.append(WalkText(prompt, list(o.token_ids), max_new_tokens, p.domain))
                kept = o.token_ids[:max_new_tokens]  # the eval's history holds the answer it counted
                histories[p.id].append({"role": "assistant", "content": tok.decode(kept, skip_special_tokens=True)})
    return out


@torch.no_grad()
def capture(model, texts: list[WalkText], layer_ids) -> list[dict[int, torch.Tensor]]:
    """The target's hidden states ``{id: [len(prompt) + len(answer), H]}`` over each text, one forward each."""
    from draftheads.targets import hidden_states

    device = model.get_input_embeddings().weight.device
    out = []
    for t in texts:
        found, _ = hidden_states(model, torch.tensor([t.prompt + t.answer], device=device), layer_ids)
        out.append({i: h[0] for i, h in found.items()})
    return out


def row_texts(batch: dict, feats: dict[int, torch.Tensor], limit: int, most: int
              ) -> tuple[list[WalkText], list[dict[int, torch.Tensor]]]:
    """The answers of packed training rows (each run of loss-mask tokens within a document) as texts to
    walk over their first ``limit`` tokens, with the hidden states of their document up to the answer's
    end (``feats``: {id: [B, T, H]} over the rows): at most ``most``. The answer is the data's, the target's
    own when it was distilled at T = 0 (a token where the data differs from the target's argmax is one the
    engine would not have walked to, and no draft is accepted across it)."""
    texts, hidden = [], []
    ids, mask, docs = (batch[k].tolist() for k in ("input_ids", "loss_mask", "doc_ids"))
    for r in range(len(ids)):
        pos = start = 0  # the run's first position, and its document's
        for (doc, on), run in itertools.groupby(zip(docs[r], mask[r])):
            n = len(list(run))
            if pos and doc != docs[r][pos - 1]:
                start = pos
            if on and doc >= 0 and pos > start and len(texts) < most:  # an answer with a prompt before it
                texts.append(WalkText(ids[r][start:pos], ids[r][pos:pos + n], min(limit, n)))
                hidden.append({i: f[r, start:pos + n] for i, f in feats.items()})
            pos += n
    return texts, hidden


def walk(proposer: Proposer, texts: list[WalkText], hidden: list[dict[int, torch.Tensor]], tree: TreeSpec,
         rows: int = 16) -> list[SpecMetrics]:
    """Per text, the metrics of drafting ``tree`` with ``proposer`` along it (``rows`` texts at a time, as
    one batch of the engine)."""
    metrics = [SpecMetrics() for _ in texts]
    full = [t.prompt + t.answer for t in texts]
    for s in range(0, len(texts), rows):
        live = []
        for i in range(s, min(s + rows, len(texts))):
            t, p = texts[i], len(texts[i].prompt)
            st = RequestState(i, p, t.prompt + t.answer[:1], SamplingParams(max_new_tokens=t.limit), None, metrics[i])
            proposer.start(st, {k: h[:p] for k, h in hidden[i].items()})
            live.append(st)
        while live:
            for st, drafted in zip(live, proposer.propose_batch(live, tree)):
                text = full[st.rid]
                root = len(st.tokens) - 1  # the root's position in the text
                n = _accepted(drafted, text, root)
                if len(drafted) > 1:  # a step that drafted nothing is a plain step, as the engine counts it
                    st.metrics.record_draft(drafted.depth, n, draft_tokens=len(drafted) - 1)
                st.metrics.target_forwards += 1
                st.tokens.extend(text[root + 1: root + 2 + n])
                st.done = len(st.generated) >= st.params.max_new_tokens or len(st.tokens) >= len(text)
                if st.done:
                    proposer.finish(st)
                else:
                    proposer.observe(st, {k: h[root: root + n + 1] for k, h in hidden[st.rid].items()}, n + 1)
            live = [st for st in live if not st.done]
    return metrics


def _accepted(tree: Tree, text: list[int], root: int) -> int:
    """How many drafted tokens of ``tree`` (rooted at text position ``root``) the greedy walk accepts: the
    target's argmax after a node at depth d on the path is the text's token at root + 1 + d."""
    want = [text[root + 1 + d] if root + 1 + d < len(text) else -1 for d in depths(tree.parents)]
    return len(verify_greedy(tree, want).accepted)


def summary(texts: list[WalkText], metrics: list[SpecMetrics]) -> dict:
    """τ, α per position and counts, over every text and per domain."""
    def merged(ms):
        total = SpecMetrics()
        for m in ms:
            total = total.merge(m)
        return {"tau": total.tau, "alpha": total.alpha, "drafts": total.drafts, "accepted": total.accepted,
                "draft_tokens": total.draft_tokens, "texts": len(ms)}

    domains = sorted({t.domain for t in texts})
    return {"overall": merged(metrics),
            "domains": {d: merged([m for t, m in zip(texts, metrics) if t.domain == d]) for d in domains}}


def markdown(res: dict) -> str:
    """The table of a ``draftheads walk`` run: τ and α per mode, and τ per domain."""
    modes = res["modes"]
    k = max((len(v["overall"]["alpha"]) for v in modes.values()), default=0)
    domains = sorted({d for v in modes.values() for d in v["domains"]})
    head = "| mode | τ | " + " | ".join(f"α@{i + 1}" for i in range(k)) + " | " + \
        " | ".join(f"τ {d}" for d in domains) + " | drafts |"
    lines = [f"`{res['command']}` (walked, {res['dtype']})", "", head, "|" + "---|" * (head.count("|") - 1)]
    for mode, v in modes.items():
        o = v["overall"]
        alpha = [f"{a:.3f}" for a in o["alpha"]] + [""] * (k - len(o["alpha"]))
        per = [f"{v['domains'][d]['tau']:.2f}" if d in v["domains"] else "" for d in domains]
        lines.append(f"| {mode} | {o['tau']:.3f} | " + " | ".join(alpha) + " | " + " | ".join(per) +
                     f" | {o['drafts']} |")
    return "\n".join(lines) + "\n"
