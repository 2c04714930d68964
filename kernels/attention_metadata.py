"""What one forward step tells the attention kernel about its sequences.

The step's new tokens are flattened: sequence 0's tokens, then sequence 1's, and so on. Each
sequence brings `query_len` new tokens at the end of a context of `context_len` tokens (cached
prefix + new), whose KV lives in the pool blocks listed in its block table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    block_size: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # Filled by `build()`: flat slot of every new token, and the per-step tensors every layer
    # reuses (computed once per step, not once per layer).
    slot_blocks: torch.Tensor = field(init=False)
    slot_offsets: torch.Tensor = field(init=False)
    kernel_state: dict = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if not (len(self.query_lens) == len(self.context_lens) == len(self.block_tables)):
            raise ValueError("query_lens, context_lens and block_tables must have equal length")
        blocks: list[int] = []
        offsets: list[int] = []
        for q_len, ctx, table in zip(
            self.query_lens, self.context_lens, self.block_tables, strict=True
        ):
            if q_len <= 0 or q_len > ctx:
                raise ValueError(f"bad query_len {q_len} for context_len {ctx}")
            if len(table) * self.block_size < ctx:
                raise ValueError(
                    f"block table of {len(table)} blocks cannot hold {ctx} tokens "
                    f"(block_size {self.block_size})"
                )
            for pos in range(ctx - q_len, ctx):
                blocks.append(table[pos // self.block_size])
                offsets.append(pos % self.block_size)
        self.slot_blocks = torch.tensor(blocks, dtype=torch.long, device=self.device)
        self.slot_offsets = torch.tensor(offsets, dtype=torch.long, device=self.device)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def positions(self) -> torch.Tensor:
        """Absolute position of every new token (what RoPE needs)."""
        parts = [
            torch.arange(ctx - q, ctx, device=self.device)
            for q, ctx in zip(self.query_lens, self.context_lens, strict=True)
        ]
        return torch.cat(parts)
