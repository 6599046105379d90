"""The speculative decoding engine: propose -> one target forward over every row's tree -> verify ->
commit -> proposer update. Without a proposer the same loop is the plain-decode baseline.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from draftheads.errors import DraftheadsError
from draftheads.inference.attention import PagedStep, StepCache, cache_argument, paged_attention
from draftheads.inference.kv_cache import PagedKVCache
from draftheads.inference.metrics import SpecMetrics
from draftheads.inference.proposers.base import Proposer, RequestState
from draftheads.inference.sampling import SamplingParams, sample_next, target_probs
from draftheads.inference.tree import Tree, ancestor_mask, depths
from draftheads.inference.verify import VerifyResult, verify_greedy, verify_sampled
from draftheads.targets import capture_hidden_states, decoder_parts


@dataclass
class GenerationOutput:
    rid: int
    prompt_ids: list[int]
    token_ids: list[int]
    metrics: SpecMetrics
    finish_reason: str = "length"


@dataclass
class EngineConfig:
    block_size: int = 16
    """Tokens per KV block."""
    kv_blocks: int | None = None
    """Blocks in the cache (default: enough for the batch's prompts, outputs and trees)."""
    max_tree_tokens: int = 128
    """Largest tree (root included) a proposer may return."""
    use_triton: bool | None = None
    """Triton attention kernels: None = on CUDA only, True/False = force."""


@dataclass
class _Batch:
    states: list[RequestState]
    trees: list[Tree] = field(default_factory=list)


class Engine:
    def __init__(self, model, tokenizer=None, proposer: Proposer | None = None, config: EngineConfig | None = None,
                 eos_token_ids=None, policy=None, switch=None):
        self.model = model
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.policy = policy  # AutoTree: which tree (or plain) per step, from measured throughput
        self.switch = switch  # RequestSwitch: per-request speculation off when it cannot pay
        self.config = config or EngineConfig()
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.num_layers = cfg.num_hidden_layers
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_positions = getattr(cfg, "max_position_embeddings", 1 << 30)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._cache_arg = cache_argument(model)
        decoder_parts(model)  # fails early on unsupported architectures
        if eos_token_ids is None:
            eos = getattr(model.generation_config, "eos_token_id", None) if hasattr(model, "generation_config") else None
            if eos is None and tokenizer is not None:
                eos = tokenizer.eos_token_id
            eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.eos = set(eos_token_ids)
        use = self.config.use_triton
        self.use_triton = (self.device.type == "cuda") if use is None else use

    # ------------------------------------------------------------------ forward

    def forward(self, cache: PagedKVCache, states, trees: list[Tree], layer_ids, keep: list[int] | None = None):
        """One target forward over every row's tree; returns (logits [total_q or len(keep), V],
        hidden {id: [total_q, H]}). ``keep``: flattened query indices whose logits are needed."""
        ids, pos, write, row_slots, masks, starts, prefix, ranges = [], [], [], [], [], [0], [], []
        for st, tree in zip(states, trees):
            start = cache.length(st.rid)
            prefix.append(start)
            cache.reserve(st.rid, len(tree))
            slots = cache.slots(st.rid, 0, start + len(tree))
            ids.extend(tree.tokens)
            pos.extend(d + start for d in depths(tree.parents))
            write.append(slots[start:])
            row_slots.append(slots)
            ranges.append(cache.contiguous(st.rid, start + len(tree)))
            masks.append(ancestor_mask(tree.parents).to(self.device))
            starts.append(starts[-1] + len(tree))
        step = PagedStep(
            cache=cache, query_start=starts, prefix_lens=prefix,
            write_slots=torch.cat(write), row_slots=row_slots, tree_masks=masks,
            block_tables=[cache.block_table(st.rid) for st in states] if self.use_triton else [],
            use_triton=self.use_triton, row_ranges=ranges,
        )
        input_ids = torch.tensor([ids], device=self.device)
        position_ids = torch.tensor([pos], device=self.device)
        with torch.no_grad(), paged_attention(self.model), capture_hidden_states(self.model, layer_ids) as found:
            out = self.model(
                input_ids=input_ids, position_ids=position_ids, use_cache=True,
                logits_to_keep=0 if keep is None else torch.tensor(keep, device=self.device),
                **{self._cache_arg: StepCache(step)}, paged_step=step,
            )
        return out.logits[0], {i: h[0] for i, h in found.items()}

    # ------------------------------------------------------------------ generation

    def _new_cache(self, prompts, params: list[SamplingParams]) -> PagedKVCache:
        blocks = self.config.kv_blocks
        if blocks is None:
            per_row = [len(p) + sp.max_new_tokens + self.config.max_tree_tokens for p, sp in zip(prompts, params)]
            blocks = sum(-(-n // self.config.block_size) + 1 for n in per_row)
        return PagedKVCache(self.num_layers, blocks, self.kv_heads, self.head_dim, self.config.block_size,
                            self.dtype, self.device, use_triton=self.use_triton)

    def _emit(self, st: RequestState, tokens: list[int]) -> None:
        budget = st.params.max_new_tokens - len(st.generated)
        for t in tokens[:budget]:
            st.tokens.append(t)
            if st.params.stop_at_eos and t in self.eos:
                st.done = True
                return
        if len(st.generated) >= st.params.max_new_tokens:
            st.done = True

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 progress=None) -> list[GenerationOutput]:
        """Generate for a batch of tokenised prompts (different lengths allowed)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise DraftheadsError("every prompt needs at least one token")
        params = params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        for p, sp in zip(prompts, params):
            if len(p) + sp.max_new_tokens + self.config.max_tree_tokens > self.max_positions:
                raise DraftheadsError(
                    f"prompt of {len(p)} tokens + max_new_tokens {sp.max_new_tokens} exceeds the target's context "
                    f"of {self.max_positions} positions: shorten the prompt or lower --max-new-tokens"
                )
        cache = self._new_cache(prompts, params)
        layer_ids = tuple(self.proposer.layer_ids) if self.proposer else ()
        states = []
        for rid, (p, sp) in enumerate(zip(prompts, params)):
            gen = torch.Generator(device="cpu").manual_seed(sp.seed)
            states.append(RequestState(rid, len(p), list(p), sp, gen))
            cache.add(rid)
        t0 = time.perf_counter()
        # prefill: each prompt is a chain; all committed; the first token comes from the last position
        trees = [Tree(list(st.tokens), [-1] + list(range(len(st.tokens) - 1))) for st in states]
        ends = list(itertools.accumulate(len(t) for t in trees))
        logits, hidden = self.forward(cache, states, trees, layer_ids, keep=[e - 1 for e in ends])
        off = 0
        for row, st in enumerate(states):
            n = len(st.tokens)
            cache.truncate(st.rid, n)
            first = sample_next(logits[row], st.params, st.generator)
            self._emit(st, [first])
            if self.proposer:
                self.proposer.start(st, {i: h[off: off + n] for i, h in hidden.items()})
            off += n
        step = 0
        while True:
            live = [st for st in states if not st.done]
            if not live:
                break
            step += 1
            t_step = time.perf_counter()
            arm = self._choose_arm()
            for st in live:
                if self.switch:
                    self.switch.maybe_probe(st, step)
            trees = [self._propose(st, plain=arm is None) for st in live]
            logits, hidden = self.forward(cache, live, trees, layer_ids)
            before = {st.rid: len(st.tokens) for st in live}
            fused = self._verify_fused(live, trees, logits)
            off = 0
            for row, (st, tree) in enumerate(zip(live, trees)):
                n = len(tree)
                res = fused[row] if fused else self._verify(st, tree, logits[off: off + n])
                cache.commit(st.rid, res.path)
                drafted = n - 1
                if drafted:
                    st.metrics.record_draft(tree.depth, len(res.accepted), draft_tokens=drafted)
                st.metrics.target_forwards += 1
                self._emit(st, res.tokens)
                if self.proposer and not st.done:
                    path = torch.tensor(res.path, device=self.device) + off
                    self.proposer.observe(st, {i: h[path] for i, h in hidden.items()}, len(res.path))
                off += n
            self._after_step(arm, live, before, time.perf_counter() - t_step, step, trees)
            if progress:
                progress(sum(len(st.generated) for st in states))
        wall = time.perf_counter() - t0
        outputs = []
        for st in states:
            cache.release(st.rid)
            if self.proposer:
                self.proposer.finish(st)
            st.metrics.emitted_tokens = len(st.generated)
            st.metrics.wall_time_s = wall
            reason = "stop" if st.generated and st.generated[-1] in self.eos else "length"
            outputs.append(GenerationOutput(st.rid, st.tokens[: st.prompt_len], st.generated, st.metrics, reason))
        return outputs

    def _choose_arm(self):
        if self.policy is None or self.proposer is None:
            return "fixed"
        arm = self.policy.choose()
        if arm is not None:
            self.proposer.set_tree(arm)
        return arm

    def _after_step(self, arm, live, before, seconds, step, trees) -> None:
        if self.policy is None or self.proposer is None:
            return
        emitted = {st.rid: len(st.tokens) - before[st.rid] for st in live}
        self.policy.update(arm, sum(emitted.values()), seconds)
        ratio = self.policy.cost_ratio(arm)
        if self.switch and ratio is not None:
            for st, tree in zip(live, trees):
                if len(tree) > 1 and not st.done:
                    self.switch.observe(st, emitted[st.rid], step, ratio)

    def _propose(self, st: RequestState, plain: bool = False) -> Tree:
        if self.proposer is None or not st.speculate or plain:
            return Tree([st.root], [-1])
        tree = self.proposer.propose(st)
        if tree.tokens[0] != st.root:
            raise RuntimeError(f"proposer {self.proposer.name} returned a tree not rooted at the last token")
        if len(tree) > self.config.max_tree_tokens:
            raise DraftheadsError(f"tree of {len(tree)} tokens exceeds max_tree_tokens={self.config.max_tree_tokens}")
        return tree

    def _verify_fused(self, live, trees, logits) -> list[VerifyResult] | None:
        """Triton path: the greedy walk of every row in one launch (greedy rows, real drafts only)."""
        if not self.use_triton or getattr(self.proposer, "name", None) == "synthetic" \
                or not all(st.params.greedy for st in live) or max(len(t) for t in trees) == 1:
            return None
        from draftheads.kernels.verify import greedy_verify

        width = max(len(t) for t in trees)
        argmax = logits.argmax(-1).to(torch.int32)
        tokens = torch.full((len(trees), width), -1, dtype=torch.int32)
        parents = torch.full((len(trees), width), -2, dtype=torch.int32)
        am = torch.full((len(trees), width), -1, dtype=torch.int32, device=self.device)
        off = 0
        for r, t in enumerate(trees):
            tokens[r, : len(t)] = torch.tensor(t.tokens, dtype=torch.int32)
            parents[r, : len(t)] = torch.tensor(t.parents, dtype=torch.int32)
            am[r, : len(t)] = argmax[off: off + len(t)]
            off += len(t)
        sizes = torch.tensor([len(t) for t in trees], dtype=torch.int32, device=self.device)
        acc, count = greedy_verify(tokens.to(self.device), parents.to(self.device), am, sizes)
        acc, count, am = acc.cpu(), count.cpu(), am.cpu()
        out = []
        for r, t in enumerate(trees):
            nodes = acc[r, : int(count[r])].tolist()
            last = nodes[-1] if nodes else 0
            out.append(VerifyResult(nodes, [t.tokens[i] for i in nodes] + [int(am[r, last])]))
        return out

    def _verify(self, st: RequestState, tree: Tree, logits: torch.Tensor) -> VerifyResult:
        if getattr(self.proposer, "name", None) == "synthetic" and len(tree) > 1:
            n = self.proposer.accepted_length()  # speed measurements only: acceptance by given rates
            return VerifyResult(list(range(1, n + 1)), tree.tokens[1: n + 1] + [int(logits[n].argmax())])
        if st.params.greedy:
            return verify_greedy(tree, logits.argmax(-1).tolist())
        return verify_sampled(tree, target_probs(logits, st.params), st.generator)


def aggregate(outputs: list[GenerationOutput]) -> SpecMetrics:
    total = SpecMetrics()
    for o in outputs:
        total = total.merge(o.metrics)
    if outputs:
        total.wall_time_s = max(o.metrics.wall_time_s for o in outputs)
    return total
