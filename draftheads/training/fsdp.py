"""FSDP for draft-head training: every decoder layer (the frozen target's and the draft's) is its own
wrap unit, and so are the frozen target and the head as wholes, so frozen and trainable parameters, and
the target's bf16 and the head's float32, never share a flat parameter.

Three things Lightning's FSDP does not do for a frozen target plus a head, handled here:

* buffers stay float32 under ``bf16-mixed`` / ``16-mixed`` (Lightning casts them with the parameters, so
  RoPE's ``inv_freq`` would drift the target's features);
* norm clipping goes through the root FSDP module (:func:`clip_grad_norm`; Lightning's FSDP precision
  plugin refuses ``gradient_clip_val``);
* the head's full weights are gathered by every rank together (:func:`full_state_dict`, a collective),
  and only then written by rank 0; the target's unit takes no part (the module's ``state_dict`` leaves
  it out), so no rank ever holds a full copy of a large target.
"""

from __future__ import annotations

import functools

import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn


def decoder_layer_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int, units: frozenset = frozenset()) -> bool:
    """torch FSDP auto-wrap policy: wrap any ``*DecoderLayer`` module (Llama, Qwen, Mistral, draft), and
    the modules whose ids are in ``units``."""
    return True if recurse else id(module) in units or type(module).__name__.endswith("DecoderLayer")


def draft_head_policy(model: nn.Module):
    """:func:`decoder_layer_policy` with ``model.target`` and ``model.head`` (a :class:`DraftHeadModule`'s)
    as units of their own: what the layers leave over (embeddings, lm_heads, ``fc``, norms) then sits in
    the target's unit or the head's, never in one flat parameter of two dtypes."""
    parts = (getattr(model, "target", None), getattr(model, "head", None))
    return functools.partial(decoder_layer_policy, units=frozenset(id(m) for m in parts if isinstance(m, nn.Module)))


class DecoderLayerFSDP(FSDPStrategy):
    """``FSDPStrategy`` with :func:`draft_head_policy` and ``use_orig_params=True``."""

    def __init__(self, sharding_strategy: str = "FULL_SHARD", **kwargs):
        kwargs.setdefault("auto_wrap_policy", decoder_layer_policy)
        kwargs.setdefault("use_orig_params", True)
        super().__init__(sharding_strategy=sharding_strategy, **kwargs)

    def _setup_model(self, model: nn.Module) -> nn.Module:
        if self.kwargs.get("auto_wrap_policy") is decoder_layer_policy:  # the target and head exist by now
            self.kwargs["auto_wrap_policy"] = draft_head_policy(model)
        return super()._setup_model(model)

    @property
    def mixed_precision_config(self):
        """The precision plugin's config with float32 buffers (RoPE tables, norms' running state)."""
        cfg = super().mixed_precision_config
        if cfg is None or cfg.buffer_dtype in (None, torch.float32):
            return cfg
        from dataclasses import replace

        return replace(cfg, buffer_dtype=torch.float32)


def is_fsdp(strategy) -> bool:
    return isinstance(strategy, FSDPStrategy)


def clip_grad_norm(strategy, max_norm: float) -> torch.Tensor:
    """Clip by the global norm over every rank's shards (the root FSDP module's own ``clip_grad_norm_``);
    returns that norm, before clipping."""
    return strategy.model.clip_grad_norm_(max_norm)


def full_state_dict(strategy) -> dict:
    """The LightningModule's state dict with full tensors. Under FSDP every rank must call this (it
    gathers shard by shard, to rank 0's CPU); elsewhere it is the module's own state dict."""
    if not is_fsdp(strategy):
        return strategy.lightning_module_state_dict()
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    on_cpu = next(strategy.model.parameters()).device.type == "cpu"  # gloo on CPU: nothing to offload
    with FSDP.state_dict_type(strategy.model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=not on_cpu, rank0_only=True)):
        return strategy.model.state_dict()
