"""The device KV pool: one preallocated tensor that every sequence's KV lives in.

Layout is block-major, ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``,
so one block's KV for *all* layers is a single contiguous byte range. That is what makes
moving a block cheap everywhere else: spilling to the host tier, swapping back, and the
KV-transfer backends (one descriptor per block instead of one per block per layer).
Attention reads per-layer strided views of the same storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.hostmem.huge_pages import zeros_tensor


@dataclass(frozen=True)
class KVLayout:
    """Shape of one KV block; two pools can exchange blocks only if their layouts are equal."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype = torch.float32

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_numel(self) -> int:
        n = 1
        for dim in self.block_shape:
            n *= dim
        return n

    @property
    def block_bytes(self) -> int:
        return self.block_numel * torch.empty((), dtype=self.dtype).element_size()


class KVPool:
    """Owns the KV tensor; knows nothing about which sequence uses which block."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu"):
        if num_blocks <= 0:
            raise ValueError(f"KV pool needs at least one block, got num_blocks={num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (num_blocks, *layout.block_shape)
        if torch.device(device).type == "cpu":
            # On huge pages: a decode step reads K/V across tens of thousands of 4 KiB pages.
            self.tensor = zeros_tensor(shape, layout.dtype)
        else:
            self.tensor = torch.zeros(shape, dtype=layout.dtype, device=device)

    @classmethod
    def from_budget(
        cls, layout: KVLayout, budget_bytes: int, device: str | torch.device = "cpu"
    ) -> KVPool:
        num_blocks = budget_bytes // layout.block_bytes
        if num_blocks <= 0:
            raise ValueError(
                f"KV memory budget of {budget_bytes} bytes is smaller than one block "
                f"({layout.block_bytes} bytes)"
            )
        return cls(layout, num_blocks, device)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def key_cache(self, layer: int) -> torch.Tensor:
        """Strided view ``[num_blocks, block_size, num_kv_heads, head_dim]`` of one layer's keys."""
        return self.tensor[:, layer, 0]

    def value_cache(self, layer: int) -> torch.Tensor:
        return self.tensor[:, layer, 1]

    def block_view(self, block_id: int) -> torch.Tensor:
        """The contiguous storage of one block (all layers, K and V)."""
        return self.tensor[block_id]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy ``[len(block_ids), *block_shape]``; safe to keep after the blocks are reused."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        return self.tensor.index_select(0, index)

    def move_slots(self, block_ids: list[int], moves: list[tuple[int, int]]) -> None:
        """Copy the K/V of every layer from position `src` to position `dst` of the sequence
        whose blocks are `block_ids`, for each (src, dst) in order (a verified draft tree's
        accepted nodes moving to the slots a chain would have used)."""
        bs = self.layout.block_size
        for src, dst in moves:
            self.tensor[block_ids[dst // bs], :, :, dst % bs] = self.tensor[
                block_ids[src // bs], :, :, src % bs
            ]

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        if data.shape[1:] != self.tensor.shape[1:] or data.shape[0] != len(block_ids):
            raise ValueError(
                f"block data of shape {tuple(data.shape)} does not fit {len(block_ids)} blocks "
                f"of shape {self.layout.block_shape}"
            )
        index = torch.tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        self.tensor.index_copy_(0, index, data.to(self.tensor.dtype))
