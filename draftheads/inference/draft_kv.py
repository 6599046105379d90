"""Preallocated K/V of a draft model's layers, shared by every request of a proposer.

Layout: ``k`` and ``v`` of shape ``[layers, slots, kv_heads, capacity, head_dim]``; a request owns one slot
and its committed entries sit at positions ``0 .. length - 1`` of it. A drafting forward writes its
query tokens' K/V at given positions of their slots (committed entries after the last one, or a
step's tree entries, which the next step overwrites) and attends over ``[:, :, :keys]`` of the
rows' slots with an explicit mask, so no forward concatenates K/V. The buffer grows by doubling
(a copy only when a request outgrows it).
"""

from __future__ import annotations

import torch


class DraftKV:
    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device, capacity: int = 256,
                 layers: int = 1):
        self.kv_heads, self.head_dim, self.dtype, self.device = kv_heads, head_dim, dtype, torch.device(device)
        self.k = self.v = torch.empty(layers, 0, kv_heads, capacity, head_dim, dtype=dtype, device=self.device)
        self.slot: dict[int, int] = {}  # request id -> slot
        self.length: dict[int, int] = {}  # request id -> committed entries
        self._free: list[int] = []

    def add(self, rid: int) -> None:
        if not self._free:
            n = self.k.shape[1]
            self._resize(max(1, 2 * n), self.k.shape[3])
            self._free = list(range(self.k.shape[1] - 1, n - 1, -1))
        self.slot[rid] = self._free.pop()
        self.length[rid] = 0

    def release(self, rid: int) -> None:
        self._free.append(self.slot.pop(rid))
        self.length.pop(rid)

    def reserve(self, positions: int) -> None:
        """Room for ``positions`` entries in every slot."""
        cap = self.k.shape[3]
        if positions > cap:
            while cap < positions:
                cap *= 2
            self._resize(self.k.shape[1], cap)

    def _resize(self, slots: int, capacity: int) -> None:
        shape = (self.k.shape[0], slots, self.kv_heads, capacity, self.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        n, c = self.k.shape[1], self.k.shape[3]
        k[:, :n, :, :c] = self.k
        v[:, :n, :, :c] = self.v
        self.k, self.v = k, v

    def step(self, rids: list[int], write_at: torch.Tensor, keys: int) -> DraftStep:
        """The cache argument of one forward over requests ``rids``: query token t of row r writes at
        position ``write_at[r, t]`` ([rows, T] long, on the device) and attends over positions below
        ``keys``."""
        self.reserve(keys)
        slots = [self.slot[r] for r in rids]
        return DraftStep(self, slots, write_at, keys)


class DraftStep:
    """Passed to the draft attention as its cache: ``update`` writes the new K/V of a layer (``at``: the
    cache of one layer) and returns the keys and values to attend over, [rows, kv_heads, keys, D]."""

    def __init__(self, kv: DraftKV, slots: list[int], write_at: torch.Tensor, keys: int):
        self.kv, self.keys = kv, keys
        self.write_at = write_at
        first = slots[0]
        self.span = slice(first, first + len(slots)) if slots == list(range(first, first + len(slots))) else None
        self.rows = torch.tensor(slots, dtype=torch.long, device=kv.device)

    def at(self, layer: int) -> LayerStep:
        return LayerStep(self, layer)

    def update(self, k: torch.Tensor, v: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v [rows, kv_heads, T, D] -> buffers indexed [rows, T] (advanced dims first): [rows, T, kv_heads, D]
        rows = self.rows[:, None]
        ks, vs = self.kv.k[layer], self.kv.v[layer]
        ks[rows, :, self.write_at] = k.transpose(1, 2).to(self.kv.dtype)
        vs[rows, :, self.write_at] = v.transpose(1, 2).to(self.kv.dtype)
        if self.span is not None:  # the rows' slots are consecutive: read a view
            return ks[self.span, :, : self.keys], vs[self.span, :, : self.keys]
        return ks[self.rows, :, : self.keys], vs[self.rows, :, : self.keys]


class LayerStep:
    """One layer's view of a :class:`DraftStep`."""

    def __init__(self, step: DraftStep, layer: int):
        self.step, self.layer = step, layer

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.step.update(k, v, self.layer)
