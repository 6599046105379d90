"""Continuous batching for plain generation: the engine's paged forward over a batch that is refilled
from a queue as rows finish, so the batch stays full however different the answers' lengths are.

Every step feeds each row its pending tokens in one target forward: a new row's whole prompt (its
prefill), a row's last sampled token (decode), or the template tokens that open a conversation's next
user turn. Rows at different stages share the forward, as vLLM mixes prefill and decode.

With ``capture`` layer ids, the hidden states of every fed token are kept (in the storage dtype), so a
finished conversation carries its target features for prompt and answer from the generation pass
itself; the last sampled token is fed once more so that its features exist too.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from draftheads.errors import DraftheadsError
from draftheads.inference.engine import Engine
from draftheads.inference.kv_cache import PagedKVCache
from draftheads.inference.proposers.base import RequestState
from draftheads.inference.sampling import SamplingParams, sample_rows
from draftheads.inference.tree import Tree
from draftheads.kernels.linear_argmax import linear_argmax


@dataclass
class Conversation:
    """One request: the tokens of the first prompt, then the template tokens that open each later user
    turn (appended after the previous answer's end-of-turn token)."""

    key: object
    segments: list[list[int]]
    params: SamplingParams


def check_first_prompt(conv: Conversation, max_seq_len: int) -> list[int]:
    """The conversation's first prompt, refused when empty or not below ``max_seq_len`` tokens."""
    if not conv.segments or not conv.segments[0]:
        raise DraftheadsError(f"conversation {conv.key!r} has an empty prompt")
    first = conv.segments[0]
    if len(first) >= max_seq_len:
        raise DraftheadsError(
            f"prompt {conv.key!r} has {len(first)} tokens, not below the max sequence length "
            f"{max_seq_len}: raise --max-seq-len or shorten the prompt"
        )
    return first


@dataclass
class Finished:
    key: object
    token_ids: list[int]  # the whole conversation as the target saw it
    answers: list[list[int]]  # generated ids per answered turn (end-of-turn token included when produced)
    truncated: list[bool]  # per answered turn: cut at its token budget, no end-of-turn token
    loss_mask: list[int]  # 1 on generated tokens
    features: dict[int, torch.Tensor] = field(default_factory=dict)  # {id: [len(token_ids), H]}
    target_argmax: torch.Tensor | None = None  # [len(token_ids)] the target's greedy next token


@dataclass
class _Row:
    conv: Conversation
    state: RequestState
    region: range  # the KV blocks this row owns until it finishes
    pending: list[int]
    turn: int = 0
    answer_start: int = 0
    answers: list[list[int]] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    feats: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    argmax: list[torch.Tensor] = field(default_factory=list)
    closing: bool = False  # the last token is being fed for its features only


class ContinuousBatcher:
    """Plain generation over ``engine``'s paged forward with refill (``engine`` has no proposer)."""

    def __init__(self, engine: Engine, batch_size: int = 64, max_seq_len: int | None = None,
                 capture: tuple[int, ...] = (), feature_dtype: torch.dtype = torch.bfloat16):
        """``max_seq_len``: tokens a conversation may reach, prompts included (default: the target's
        context, at most 2048); an answer that reaches it is cut and marked truncated."""
        if max_seq_len is None:
            max_seq_len = min(2048, engine.max_positions)
        if batch_size < 1:
            raise DraftheadsError(f"batch size {batch_size} must be >= 1")
        if max_seq_len < 2 or max_seq_len > engine.max_positions:
            raise DraftheadsError(
                f"max sequence length {max_seq_len} must be in [2, {engine.max_positions}] (the target's context)"
            )
        self.engine = engine
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.capture = tuple(sorted(set(capture)))
        self.feature_dtype = feature_dtype
        self.last = engine.num_layers  # final-norm hidden state, for the target's argmax
        self.tokens_generated = 0

    def _layers(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.capture) | {self.last})) if self.capture else ()

    def run(self, conversations: Iterable[Conversation]) -> Iterator[Finished]:
        """Yield each conversation as it finishes (completion order, not input order)."""
        eng, bs = self.engine, self.batch_size
        blocks_per_row = -(-self.max_seq_len // eng.config.block_size) + 1
        cache = eng.new_cache(bs * blocks_per_row)
        queue = iter(conversations)
        free_regions = [range(i * blocks_per_row, (i + 1) * blocks_per_row) for i in range(bs)]
        rows: list[_Row] = []
        ids = itertools.count()
        lm_head = eng.model.get_output_embeddings().weight
        while True:
            while len(rows) < bs:
                conv = next(queue, None)
                if conv is None:
                    break
                rows.append(self._admit(conv, next(ids), cache, free_regions.pop()))
            if not rows:
                return
            trees = [Tree(r.pending, [-1] + list(range(len(r.pending) - 1))) for r in rows]
            ends = list(itertools.accumulate(len(t) for t in trees))
            node_logits, hidden = eng.forward(cache, [r.state for r in rows], trees, self._layers())
            logits = node_logits.rows([e - 1 for e in ends])
            stored = {i: h.to(self.feature_dtype) for i, h in hidden.items() if i in self.capture}
            picked = sample_rows(logits, [r.state.params for r in rows], [r.state.generator for r in rows])
            greedy = logits.argmax(-1).tolist() if self.capture else None  # the target's argmax, for the cache
            still = []
            for n, row in enumerate(rows):
                s, e = ends[n] - len(trees[n]), ends[n]
                cache.truncate(row.state.rid, cache.length(row.state.rid) + (e - s))
                if self.capture:
                    for i, h in stored.items():
                        row.feats.setdefault(i, []).append(h[s:e])
                    am = torch.empty(e - s, dtype=torch.long)
                    if e - s > 1:  # prompt positions: the logits were not kept, project their last state
                        am[:-1] = linear_argmax(hidden[self.last][s: e - 1], lm_head).cpu()
                    am[-1] = greedy[n]
                    row.argmax.append(am)
                if row.closing or not self._step(row, picked[n]):
                    free_regions.append(row.region)
                    cache.release(row.state.rid)
                    yield self._finish(row)
                else:
                    still.append(row)
            rows = still

    # ------------------------------------------------------------------ per row

    def _admit(self, conv: Conversation, rid: int, cache: PagedKVCache, region: range) -> _Row:
        first = check_first_prompt(conv, self.max_seq_len)
        state = self.engine.request_state(rid, first, conv.params)
        cache.add(rid, region)  # a contiguous region per row: attention reads its K/V without a gather
        return _Row(conv, state, region, list(first), answer_start=len(first), mask=[0] * len(first))

    def _budget(self, row: _Row) -> int:
        """New tokens this turn may still take (the turn's max, and the sequence's room)."""
        made = len(row.state.tokens) - row.answer_start
        room = self.max_seq_len - len(row.state.tokens)
        return min(row.conv.params.max_new_tokens - made, room)

    def _step(self, row: _Row, tok: int) -> bool:
        """Take the token sampled after a forward; False when the conversation is over (and needs no closing
        feed)."""
        st = row.state
        st.tokens.append(tok)
        row.mask.append(1)
        self.tokens_generated += 1
        eos = st.params.stop_at_eos and tok in self.engine.eos
        if not eos and self._budget(row) > 0:
            row.pending = [tok]
            return True
        row.answers.append(st.tokens[row.answer_start:])
        row.truncated.append(not eos)
        row.turn += 1
        nxt = row.conv.segments[row.turn] if eos and row.turn < len(row.conv.segments) else None
        if nxt is not None and len(st.tokens) + len(nxt) < self.max_seq_len:
            st.tokens.extend(nxt)
            row.mask.extend([0] * len(nxt))
            row.answer_start = len(st.tokens)
            row.pending = [tok, *nxt]
            return True
        if self.capture:
            row.pending, row.closing = [tok], True
            return True
        return False

    def _finish(self, row: _Row) -> Finished:
        st = row.state
        out = Finished(row.conv.key, list(st.tokens), row.answers, row.truncated, row.mask)
        if self.capture:
            out.features = {i: torch.cat(v) for i, v in row.feats.items()}
            out.target_argmax = torch.cat(row.argmax)
            assert out.target_argmax.shape[0] == len(out.token_ids), (out.target_argmax.shape, len(out.token_ids))
        return out
