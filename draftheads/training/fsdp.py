"""FSDP for draft-head training: every decoder layer (the frozen target's and the draft's) is its own
wrap unit, so frozen and trainable parameters never share a flat parameter."""

from __future__ import annotations

from lightning.pytorch.strategies import FSDPStrategy
from torch import nn


def decoder_layer_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    """torch FSDP auto-wrap policy: wrap any ``*DecoderLayer`` module (Llama, Qwen, Mistral, draft)."""
    return True if recurse else type(module).__name__.endswith("DecoderLayer")


class DecoderLayerFSDP(FSDPStrategy):
    """``FSDPStrategy`` with :func:`decoder_layer_policy` and ``use_orig_params=True``."""

    def __init__(self, sharding_strategy: str = "FULL_SHARD", **kwargs):
        kwargs.setdefault("auto_wrap_policy", decoder_layer_policy)
        kwargs.setdefault("use_orig_params", True)
        super().__init__(sharding_strategy=sharding_strategy, **kwargs)
