"""The attention kernel interface the model calls once per layer.

A kernel writes the step's new K/V into their paged slots, then computes attention of the new
queries over each sequence's whole context (cached prefix + new tokens, causal among the new),
or, for a sliding-window layer, over the window's most recent keys only.
The torch reference runs everywhere; Triton kernels plug in behind the same interface on CUDA.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kernels.attention_metadata import AttentionMetadata


class AttentionKernel(ABC):
    name: str
    # Whether `meta.trees` (draft-tree query rows: tree positions and ancestor masks) are
    # honoured; the engine drafts chains only where they are not.
    supports_trees: bool = False

    def prepare(self, meta: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Precompute per-step state into `meta.kernel_state` (called once per step)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [tokens, num_heads, head_dim]
        k: torch.Tensor,  # [tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,  # sliding window: each query sees its `window` latest keys
    ) -> torch.Tensor:  # [tokens, num_heads, head_dim]
        ...


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Store the new tokens' K/V in their slots; the cache views may be strided (block-major)."""
    key_cache[meta.slot_blocks, meta.slot_offsets] = k.to(key_cache.dtype)
    value_cache[meta.slot_blocks, meta.slot_offsets] = v.to(value_cache.dtype)
