"""Tree attention over the paged KV cache, plugged into unmodified HF models.

One target forward runs the query tokens of every batch row flattened into a single sequence
(``input_ids`` [1, total_q]), as vLLM treats a K-token verification as an ordinary row with query
length K+1. Two pieces reach into the model without touching its code:

* :class:`StepCache`, passed as the model's cache: its ``update`` writes the new K/V (after RoPE)
  into the paged cache at the step's slots;
* :func:`paged_tree_attention`, registered through ``AttentionInterface`` as ``draftheads_paged``:
  each query token attends to its row's committed prefix plus its tree ancestors and itself.

The torch path gathers each row's K/V and calls SDPA with an additive float mask (transformers'
eager path is silently wrong with bool 4D masks). The Triton path (``draftheads.kernels``) reads the
pages directly.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from draftheads.inference.kv_cache import PagedKVCache

ATTN_NAME = "draftheads_paged"


@dataclass
class PagedStep:
    """Per-forward attention metadata (vLLM's attention-metadata analogue)."""

    cache: PagedKVCache
    query_start: list[int]  # [rows + 1] offsets of each row's query tokens in the flattened batch
    prefix_lens: list[int]  # committed K/V length of each row before this forward
    write_slots: torch.Tensor  # [total_q] slot of each query token
    row_slots: list[torch.Tensor]  # per row: slots of prefix + query tokens [prefix_len + q]
    tree_masks: list[torch.Tensor]  # per row: [q, q] bool, True where query i may attend to query j
    block_tables: list[list[int]] = field(default_factory=list)
    use_triton: bool = False
    row_ranges: list[tuple[int, int] | None] = field(default_factory=list)  # per row: contiguous flat slots
    _additive: dict = field(default_factory=dict, repr=False)
    _triton_args: tuple | None = field(default=None, repr=False)

    @property
    def rows(self) -> int:
        return len(self.prefix_lens)

    def additive_mask(self, row: int, dtype: torch.dtype, window: int | None = None) -> torch.Tensor | None:
        """[q, prefix + q] additive mask of one row (built once per forward, dtype and window); None when
        the row's queries see everything (a single query token within the window). ``window``: a sliding
        window layer's, where a query at position p sees keys at positions > p - window (HF's rule)."""
        key = (row, dtype, window)
        if key not in self._additive:
            tree, prefix = self.tree_masks[row], self.prefix_lens[row]
            q = tree.shape[0]
            if q == 1 and (window is None or prefix < window):  # a lone query token sees every key (no host read)
                self._additive[key] = None
                return None
            m = torch.zeros(q, prefix + q, dtype=dtype, device=tree.device)
            m[:, prefix:].masked_fill_(~tree, float("-inf"))
            if window is not None:
                depth = tree.sum(1) - 1  # [q] a node's ancestors in the tree are the nodes it sees, itself included
                q_pos = prefix + depth
                k_pos = torch.cat([torch.arange(prefix, device=tree.device), q_pos])
                m.masked_fill_(k_pos[None, :] <= q_pos[:, None] - window, float("-inf"))
            self._additive[key] = m
        return self._additive[key]


class StepCache:
    """The model's cache for one forward: writes each layer's new K/V into the paged cache."""

    is_compileable = False

    def __init__(self, step: PagedStep):
        self.step = step

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key/value [1, kv_heads, total_q, head_dim]
        self.step.cache.write(layer_idx, self.step.write_slots, key_states[0].transpose(0, 1), value_states[0].transpose(0, 1))
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def torch_paged_tree_attention(query, step: PagedStep, layer: int, scaling: float,
                               window: int | None = None) -> torch.Tensor:
    """Reference: query [1, H, total_q, D] -> [total_q, H, D]. A row whose K/V lie in a reserved
    contiguous region is read as a view; other rows are gathered through their slots. The product runs
    in the cache's dtype (float32 K/V on a CPU: see ``EngineConfig.kv_dtype``), the output in the query's.
    ``window``: the layer's sliding window (None: full attention)."""
    out = torch.empty(query.shape[2], query.shape[1], query.shape[3], dtype=query.dtype, device=query.device)
    for b in range(step.rows):
        s, e = step.query_start[b], step.query_start[b + 1]
        if e == s:
            continue
        rng = step.row_ranges[b] if step.row_ranges else None
        kv = step.cache.kv_range(layer, *rng) if rng else step.cache.gather_kv(layer, step.row_slots[b])
        kv = kv.transpose(1, 2)  # [2, kv_heads, S, D]
        q = query[:, :, s:e].to(kv.dtype)  # [1, H, q, D]; 4D inputs keep SDPA on its fast CPU kernels
        o = F.scaled_dot_product_attention(
            q, kv[0:1], kv[1:2], attn_mask=step.additive_mask(b, q.dtype, window), scale=scaling, enable_gqa=True
        )
        out[s:e] = o[0].transpose(0, 1)
    return out


def paged_tree_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface entry: K/V were written by :class:`StepCache`; read them from the pages. A
    sliding-window layer (Gemma-3, Mistral: the model passes ``sliding_window``) masks the keys that fell out
    of its window, on the torch path."""
    step: PagedStep = kwargs["paged_step"]
    window = kwargs.get("sliding_window")
    if window is not None:
        out = torch_paged_tree_attention(query, step, module.layer_idx, scaling, window)
    elif step.use_triton:
        from draftheads.kernels.tree_attention import paged_tree_attention_triton

        out = paged_tree_attention_triton(query, step, module.layer_idx, scaling)
    else:
        out = torch_paged_tree_attention(query, step, module.layer_idx, scaling)
    return out.unsqueeze(0), None  # [1, total_q, H, D]


_registered = False


def ensure_registered() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_NAME, paged_tree_attention)
        _registered = True


@contextlib.contextmanager
def paged_attention(model):
    """Run ``model`` with the paged tree attention for the duration of the block."""
    ensure_registered()
    cfg = model.config
    old = cfg._attn_implementation
    cfg._attn_implementation = ATTN_NAME
    try:
        yield
    finally:
        cfg._attn_implementation = old


def cache_argument(model) -> str:
    """Name of the forward's cache argument (``cache`` in newer transformers, ``past_key_values`` before)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
