"""vLLM's hidden-states connector with a synchronous host copy, for vLLM builds without CUDA.

Runs inside vLLM's own environment (``.venv-vllm``), named by ``kv_connector_module_path``; draftheads never
imports it. With ``speculative_config={"method": "extract_hidden_states", ...}`` vLLM keeps the chosen
layers' hidden states of every computed token in a cache-only layer, and its example connector writes
them to ``<shared_storage_path>/<request>.safetensors`` (``hidden_states`` [T, layers, hidden] and
``token_ids`` [T]) when a request finishes. That connector copies through a CUDA stream into pinned
memory, which the CPU build lacks; here the cache already lives in host memory, so the rows are read
and the file written at once, and the request is reported done in the same step.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Written:
    """Stands for the copy-done event of the stock connector: the write has already happened."""

    @staticmethod
    def query() -> bool:
        return True


class HostHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).contiguous()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": hidden, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the lock readers wait on
        self._req_copy_events[pending.req_id] = _Written()
