"""The speculative decoding engine: propose -> one target forward over every row's tree -> verify ->
commit -> proposer update. Without a proposer the same loop is the plain-decode baseline.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, replace

import torch

from draftheads.errors import DraftheadsError
from draftheads.inference.attention import PagedStep, StepCache, cache_argument, paged_attention
from draftheads.inference.kv_cache import PagedKVCache
from draftheads.inference.policy import AutoPolicy, StepPlan
from draftheads.inference.proposers.base import Proposer, RequestState
from draftheads.inference.sampling import SamplingParams, request_generator, sample_rows
from draftheads.inference.tree import (
    DEFAULT_TREE,
    MAX_TREE_TOKENS,
    Tree,
    TreeSpec,
    ancestor_mask,
    depths,
    parse_tree,
)
from draftheads.inference.verify import VERIFIERS, NodeLogits
from draftheads.metrics import SpecMetrics
from draftheads.targets import capture_hidden_states, decoder_parts, eos_ids


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
    max_tree_tokens: int = MAX_TREE_TOKENS
    """Largest tree (root included) a proposer may return."""
    use_triton: bool | None = None
    """Triton attention kernels: None = on CUDA only, True/False = force."""
    verifier: str = "exact"
    """``exact`` (lossless: greedy or rejection sampling per request), ``synthetic`` (acceptance by
    ``synthetic_rates`` whatever the tokens, for speed measurements on random-weight targets) or
    ``reference`` (greedy along given texts, for timing modes on one text in reduced precision)."""
    synthetic_rates: tuple[float, ...] = ()
    """Per-position acceptance probabilities of the synthetic verifier."""
    verify_on_device: bool | None = None
    """Walk greedy trees on the device with one read-back per step: None = off the CPU (where a host
    read waits for the device) or on the Triton path, True/False = force. On a CPU the host walk
    projects fewer nodes."""
    lazy_lm_head: bool = True
    """Project the final hidden states through the lm_head only at the nodes verification reads."""
    walk_ahead: int = 3
    """The host greedy walk projects, with each node it reaches, up to this many of its likeliest
    descendants in the same lm_head call (0: one depth per call)."""
    kv_dtype: str | None = None
    """Dtype of the paged K/V: None = the model's, except on the torch path on a CPU, where a bf16 or
    fp16 model keeps float32 K/V (CPU SDPA reads float32 K/V about 3.7x faster: 6.3 against 23.4 ms
    per layer for 64 rows of 200-1000 keys, 2 threads)."""

    def __post_init__(self):
        if self.verifier not in VERIFIERS:
            raise DraftheadsError(f"verifier {self.verifier!r} is unknown: use one of {', '.join(VERIFIERS)}")


def _triton_supports(head_dim: int, block_size: int) -> bool:
    from draftheads.kernels.tree_attention import supports

    return supports(head_dim, block_size)


def _plain_head(model) -> bool:
    """True when the target's logits are its lm_head's plain projection (no soft-capping or scaling)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head = model.get_output_embeddings()
    return (isinstance(head, torch.nn.Linear) and head.bias is None
            and getattr(cfg, "final_logit_softcapping", None) is None and getattr(cfg, "logit_scale", None) is None)


class Engine:
    """``tree``: ``auto`` (the default: :class:`AutoPolicy` drafts, each step, the tree with the best
    expected tokens per second by its acceptance and cost models, plain decoding included), a tree name
    or file (always speculate with it), or a :class:`TreeSpec`. ``policy``: a prepared
    :class:`AutoPolicy` (e.g. seeded with the verify curve of ``draftheads profile``)."""

    def __init__(self, model, tokenizer=None, proposer: Proposer | None = None, config: EngineConfig | None = None,
                 eos_token_ids=None, tree: str | TreeSpec | None = None, policy: AutoPolicy | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.config = config or EngineConfig()
        tree = DEFAULT_TREE if tree is None else tree
        self.policy = self.tree = None
        if proposer is not None:
            if policy is not None or tree == "auto":
                self.policy = policy or AutoPolicy.for_proposer(proposer)
                if self.policy.pool.total_tokens > self.config.max_tree_tokens:
                    self.policy.pool = replace(self.policy.pool, total_tokens=self.config.max_tree_tokens)
                proposer.check_tree(self.policy.pool)
            else:
                self.tree = tree if isinstance(tree, TreeSpec) else parse_tree(tree)
                proposer.check_tree(self.tree)
                if self.tree.total_tokens > self.config.max_tree_tokens:
                    raise DraftheadsError(f"tree {self.tree.label} has {self.tree.total_tokens} tokens, more than "
                                          f"max_tree_tokens={self.config.max_tree_tokens}: use a smaller tree")
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.num_layers = cfg.num_hidden_layers
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_positions = getattr(cfg, "max_position_embeddings", 1 << 30)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        decoder_parts(model)  # fails early on unsupported architectures
        self._lazy = self.config.lazy_lm_head and _plain_head(model)
        self._runner = model.get_decoder() if self._lazy else model
        self._cache_arg = cache_argument(self._runner)
        if eos_token_ids is None:
            config = getattr(model, "generation_config", None)
            eos_token_ids = eos_ids(getattr(config, "eos_token_id", None), tokenizer)
        self.eos = set(eos_token_ids)
        use = self.config.use_triton
        if use is None:  # the Triton path on CUDA, where the kernel takes this model's shapes
            use = self.device.type == "cuda" and _triton_supports(self.head_dim, self.config.block_size)
        self.use_triton = use
        on_device = self.config.verify_on_device
        on_device = (self.device.type != "cpu" or use) if on_device is None else on_device
        self.verifier = VERIFIERS[self.config.verifier].from_config(self.config, on_device=on_device, kernel=use)
        self.kv_dtype = self._kv_dtype()
        self.steps = 0  # engine steps over all generate calls (the per-request switch counts in them)

    def _kv_dtype(self) -> torch.dtype:
        if self.config.kv_dtype is not None:
            dtype = getattr(torch, self.config.kv_dtype, None)
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise DraftheadsError(f"kv_dtype {self.config.kv_dtype!r} is not a float dtype: use float32, "
                                      "bfloat16 or float16")
            return dtype
        if self.device.type == "cpu" and not self.use_triton and self.dtype in (torch.bfloat16, torch.float16):
            return torch.float32
        return self.dtype

    def new_cache(self, blocks: int) -> PagedKVCache:
        """An empty paged K/V cache of ``blocks`` blocks shaped for this engine's target."""
        return PagedKVCache(self.num_layers, blocks, self.kv_heads, self.head_dim, self.config.block_size,
                            self.kv_dtype, self.device, use_triton=self.use_triton)

    def request_state(self, rid: int, prompt: list[int], params: SamplingParams) -> RequestState:
        """A new request's state; its random stream lives on the target's device."""
        return RequestState(rid, len(prompt), list(prompt), params, request_generator(params.seed, self.device))

    @property
    def mode(self) -> str:
        """What this engine does each step: plain, auto or the fixed tree's name."""
        return "plain" if self.proposer is None else "auto" if self.policy else self.tree.label

    # ------------------------------------------------------------------ forward

    def forward(self, cache: PagedKVCache, states, trees: list[Tree], layer_ids) -> tuple[NodeLogits, dict]:
        """One target forward over every row's tree (rows' nodes flattened in order); returns the
        logits at every node, projected on demand, and the captured hidden states {id: [total_q, H]}."""
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
        kw = {self._cache_arg: StepCache(step)}
        with torch.no_grad(), paged_attention(self.model), capture_hidden_states(self.model, layer_ids) as found:
            out = self._runner(input_ids=input_ids, position_ids=position_ids, use_cache=True, paged_step=step, **kw)
        hidden = {i: h[0] for i, h in found.items()}
        if self._lazy:
            return NodeLogits(out.last_hidden_state[0], self.model.get_output_embeddings().weight), hidden
        return NodeLogits(full=out.logits[0]), hidden

    # ------------------------------------------------------------------ generation

    def _new_cache(self, prompts, params: list[SamplingParams]) -> PagedKVCache:
        blocks = self.config.kv_blocks
        if blocks is None:
            per_row = [len(p) + sp.max_new_tokens + self.config.max_tree_tokens for p, sp in zip(prompts, params)]
            blocks = sum(-(-n // self.config.block_size) + 1 for n in per_row)
        return self.new_cache(blocks)

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
            states.append(self.request_state(rid, p, sp))
            cache.add(rid)
        t0 = time.perf_counter()
        # prefill: each prompt is a chain; all committed; the first token comes from the last position
        trees = [Tree(list(st.tokens), [-1] + list(range(len(st.tokens) - 1))) for st in states]
        ends = list(itertools.accumulate(len(t) for t in trees))
        logits, hidden = self.forward(cache, states, trees, layer_ids)
        first = sample_rows(logits.rows([e - 1 for e in ends]), [st.params for st in states],
                            [st.generator for st in states])
        off = 0
        for st, tok in zip(states, first):
            n = len(st.tokens)
            cache.truncate(st.rid, n)
            self._emit(st, [tok])
            if self.proposer:
                self.proposer.start(st, {i: h[off: off + n] for i, h in hidden.items()})
            if self.policy:
                self.policy.start(st)
            off += n
        while True:
            live = [st for st in states if not st.done]
            if not live:
                break
            self.steps += 1
            t_step = time.perf_counter()
            plan, trees = self._propose(live)
            t_draft = time.perf_counter() - t_step
            logits, hidden = self.forward(cache, live, trees, layer_ids)
            t_walk = time.perf_counter()
            results = self.verifier.verify(live, trees, logits)
            t_walk = time.perf_counter() - t_walk
            cache.commit_many([(st.rid, res.path) for st, res in zip(live, results)])
            off = 0
            for st, t, res in zip(live, trees, results):
                if len(t) > 1:
                    st.metrics.record_draft(t.depth, len(res.accepted), draft_tokens=len(t) - 1)
                st.metrics.target_forwards += 1
                self._emit(st, res.tokens)
                if self.proposer and not st.done:
                    path = torch.tensor(res.path, device=self.device) + off
                    self.proposer.observe(st, {i: h[path] for i, h in hidden.items()}, len(res.path))
                off += len(t)
            if self.policy:
                self.policy.update(live, plan, trees, [res.tokens for res in results], t_draft,
                                   time.perf_counter() - t_step - t_draft - t_walk, t_walk, self.steps)
            if progress:
                progress(sum(len(st.generated) for st in states))
        wall = time.perf_counter() - t0
        outputs = []
        for st in states:
            cache.release(st.rid)
            if self.proposer:
                self.proposer.finish(st)
            if self.policy:
                self.policy.finish(st)
            st.metrics.emitted_tokens = len(st.generated)
            st.metrics.wall_time_s = wall
            reason = "stop" if st.generated and st.generated[-1] in self.eos else "length"
            outputs.append(GenerationOutput(st.rid, st.tokens[: st.prompt_len], st.generated, st.metrics, reason))
        return outputs

    def _propose(self, live: list[RequestState]) -> tuple[StepPlan | None, list[Tree]]:
        """Every live row's tree for this step: the fixed tree drafted for every row, or under ``auto``
        the policy's choice of rows, depth and nodes (the root alone for a row that does not draft)."""
        if self.proposer is None:
            return None, [Tree([st.root], [-1]) for st in live]
        if self.policy is None:
            plan, out = None, self.proposer.propose_batch(live, self.tree)
        else:
            plan = self.policy.plan(live, self.steps)
            t0 = time.perf_counter()
            pools = self.proposer.propose_batch(plan.drafting, plan.spec, grow=plan.grow) if plan.drafting else []
            out = self.policy.select(live, plan, pools, time.perf_counter() - t0)
        for st, t in zip(live, out):
            if t.tokens[0] != st.root:
                raise RuntimeError(f"proposer {self.proposer.name} returned a tree not rooted at the last token")
            if len(t) > self.config.max_tree_tokens:
                raise DraftheadsError(f"tree of {len(t)} tokens exceeds max_tree_tokens={self.config.max_tree_tokens}")
        return plan, out
