"""Paged KV cache: fixed-size blocks, a free-list allocator and per-sequence block tables.

Layout: one tensor ``storage`` of shape ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``;
``kv[layer]`` (keys, values) is a view of one layer and ``k[layer]``, ``v[layer]`` its two halves, so a
kernel can reach every layer through one pointer and a stride.
A token at position p of a sequence lives in slot ``block_table[p // block_size] * block_size +
p % block_size``.

A sequence's committed length ``length`` counts the tokens whose K/V are final. A verification
forward writes its query tokens (the tree: root first) to positions ``length .. length + q - 1``;
:meth:`PagedKVCache.commit_many` then moves the accepted nodes' K/V of every row and layer to
``length + 1 ..`` (the root is already in place) in one copy, advances each ``length`` and frees blocks the
sequences no longer need.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftheads.errors import DraftheadsError


class BlocksExhausted(DraftheadsError):
    """The cache has no free block left for a sequence that needs one."""


@dataclass
class SeqBlocks:
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # committed tokens
    pinned: int = 0  # leading blocks kept however short the sequence is (a reserved region)


class PagedKVCache:
    def __init__(
        self, num_layers: int, num_blocks: int, kv_heads: int, head_dim: int,
        block_size: int = 16, dtype=torch.float32, device="cpu", use_triton: bool = False,
    ):
        if num_blocks < 1 or block_size < 1:
            raise DraftheadsError(f"kv cache needs num_blocks >= 1 and block_size >= 1 (got {num_blocks}, {block_size})")
        self.storage = torch.zeros(num_layers, 2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
        self._all_flat = self.storage.view(num_layers, 2, num_blocks * block_size, kv_heads, head_dim)
        self.kv = list(self.storage.unbind(0))  # [2, num_blocks, block_size, kv_heads, head_dim] per layer
        self.k = [t[0] for t in self.kv]
        self.v = [t[1] for t in self.kv]
        self._flat = list(self._all_flat.unbind(0))  # [2, slots, kv_heads, head_dim] per layer
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self.seqs: dict[int, SeqBlocks] = {}
        self.device = torch.device(device)
        self.use_triton = use_triton  # commit moves with the Triton kernel (one launch for all rows and layers)

    # ------------------------------------------------------------------ allocation

    def add(self, seq_id: int, region: range | None = None) -> None:
        """Start a sequence; with ``region`` (free consecutive block ids) it owns those blocks until it is
        released, so its K/V stay contiguous and attention reads them without a gather."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} already in the cache")
        seq = SeqBlocks()
        if region is not None:
            wanted = set(region)
            if len(wanted & set(self.free)) != len(wanted):
                raise ValueError(f"blocks {region} are not all free")
            self.free = [b for b in self.free if b not in wanted]
            seq.blocks, seq.pinned = list(region), len(region)
        self.seqs[seq_id] = seq

    def contiguous(self, seq_id: int, n: int) -> tuple[int, int] | None:
        """Flat slot range of positions ``0 .. n-1`` when they lie in the sequence's reserved region."""
        seq = self.seqs[seq_id]
        if n <= seq.pinned * self.block_size:
            first = seq.blocks[0] * self.block_size
            return first, first + n
        return None

    def kv_range(self, layer: int, start: int, end: int) -> torch.Tensor:
        """K and V of flat slots ``start .. end-1`` as a view -> [2, n, kv_heads, head_dim]."""
        return self._flat[layer][:, start:end]

    def length(self, seq_id: int) -> int:
        return self.seqs[seq_id].length

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        """Make room for ``num_tokens`` positions after the committed length."""
        seq = self.seqs[seq_id]
        need = -(-(seq.length + num_tokens) // self.block_size) - len(seq.blocks)
        if need > len(self.free):
            raise BlocksExhausted(
                f"KV cache exhausted: sequence {seq_id} needs {need} more blocks of {self.block_size} tokens and "
                f"{len(self.free)} are free: lower the batch size or --max-new-tokens (or give EngineConfig.kv_blocks more blocks)"
            )
        seq.blocks.extend(self.free.pop() for _ in range(need))

    def release(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id)
        self.free.extend(reversed(seq.blocks))

    def free_blocks(self) -> int:
        return len(self.free)

    # ------------------------------------------------------------------ addressing

    def slots(self, seq_id: int, start: int, n: int) -> torch.Tensor:
        """Flat slot indices of positions ``start .. start + n - 1`` (blocks must be reserved)."""
        seq = self.seqs[seq_id]
        pos = torch.arange(start, start + n)
        if n and (start + n - 1) // self.block_size >= len(seq.blocks):
            raise ValueError(f"positions up to {start + n - 1} of sequence {seq_id} are not reserved")
        table = torch.tensor(seq.blocks, dtype=torch.long)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.device)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self.seqs[seq_id].blocks)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [n, kv_heads, head_dim] into ``slots`` [n]."""
        flat = self._flat[layer]
        flat[0].index_copy_(0, slots, k.to(flat.dtype))
        flat[1].index_copy_(0, slots, v.to(flat.dtype))

    def gather_kv(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """K and V at ``slots`` in one copy -> [2, n, kv_heads, head_dim]."""
        return torch.index_select(self._flat[layer], 1, slots)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V at ``slots`` -> two [n, kv_heads, head_dim] tensors."""
        kv = self.gather_kv(layer, slots)
        return kv[0], kv[1]

    # ------------------------------------------------------------------ commit

    def commit(self, seq_id: int, accepted: list[int]) -> None:
        """Keep tree nodes ``accepted`` of one sequence: :meth:`commit_many` with one item."""
        self.commit_many([(seq_id, accepted)])

    def commit_many(self, items: list[tuple[int, list[int]]]) -> None:
        """Keep tree nodes ``accepted`` (tree indices, root = 0 first, increasing) of each ``(seq_id, accepted)``.

        Node ``accepted[d]`` was written at position ``length + accepted[d]``; it moves to ``length + d``.
        The moves of every row and layer run as one copy (one Triton launch with ``use_triton``, else one
        gather and one ``index_copy_``). Within a row they are order-safe: ``accepted`` increases, so each
        move goes to a position below the sources of all later moves (a destination may be an earlier
        move's source, already read). Then each ``length += len(accepted)`` and unneeded blocks are freed.
        """
        seen = set()
        src, dst, row_start = [], [], [0]
        for seq_id, accepted in items:
            if seq_id in seen:
                raise ValueError(f"sequence {seq_id} appears twice in one commit")
            seen.add(seq_id)
            if not accepted or accepted[0] != 0 or any(b <= a for a, b in zip(accepted, accepted[1:])):
                raise ValueError(f"accepted nodes {accepted} must start at the root (0) and increase")
            seq = self.seqs[seq_id]
            if (seq.length + accepted[-1]) // self.block_size >= len(seq.blocks):
                raise ValueError(f"positions up to {seq.length + accepted[-1]} of sequence {seq_id} are not reserved")
            for d, a in enumerate(accepted):
                if a != d:  # nodes before the first skipped one are already in place
                    src.append(self._slot(seq, seq.length + a))
                    dst.append(self._slot(seq, seq.length + d))
            row_start.append(len(src))
        if src:
            n = len(src)
            moves = torch.tensor(src + dst + row_start, dtype=torch.long).to(self.device)  # one host-to-device copy
            if self.use_triton:
                from draftheads.kernels.verify import commit_kv_layers

                commit_kv_layers(self._all_flat, moves[:n], moves[n: 2 * n], moves[2 * n:])
            else:
                self._all_flat.index_copy_(2, moves[n: 2 * n], self._all_flat.index_select(2, moves[:n]))
        for seq_id, accepted in items:
            self.truncate(seq_id, self.seqs[seq_id].length + len(accepted))

    def _slot(self, seq: SeqBlocks, pos: int) -> int:
        return seq.blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def truncate(self, seq_id: int, length: int) -> None:
        """Set the committed length and free blocks past it."""
        seq = self.seqs[seq_id]
        seq.length = length
        keep = max(-(-length // self.block_size), seq.pinned)
        while len(seq.blocks) > keep:
            self.free.append(seq.blocks.pop())
