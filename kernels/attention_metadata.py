"""What one forward step tells the attention kernel about its sequences.

The step's new tokens are flattened: sequence 0's tokens, then sequence 1's, and so on. Each
sequence brings `query_len` new tokens at the end of a context of `context_len` tokens (cached
prefix + new), whose KV lives in the pool blocks listed in its block table.

A sequence verifying a draft tree (`trees[i]`: each draft node's parent, -1 for the first
query token) keeps its query tokens in consecutive slots, but query token j sits at position
`context_len - query_len + depth(j)` and attends to the context before the first query token,
to the first query token, and to its own ancestors and itself among the rest
(engine/speculative/tree.py).
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
    # Per sequence: its draft tree's parents (len query_len - 1), or None for causal rows.
    trees: list[tuple[int, ...] | None] | None = None
    # Filled by `build()`: flat slot of every new token, and the per-step tensors every layer
    # reuses (computed once per step, not once per layer).
    slot_blocks: torch.Tensor = field(init=False)
    slot_offsets: torch.Tensor = field(init=False)
    kernel_state: dict = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if not (len(self.query_lens) == len(self.context_lens) == len(self.block_tables)):
            raise ValueError("query_lens, context_lens and block_tables must have equal length")
        if self.trees is not None:
            if len(self.trees) != len(self.query_lens):
                raise ValueError("trees must have one entry per sequence")
            for q_len, tree in zip(self.query_lens, self.trees, strict=True):
                if tree is not None and len(tree) != q_len - 1:
                    raise ValueError(f"a tree of {len(tree)} nodes needs {len(tree) + 1} queries")
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

    def tree(self, seq: int) -> tuple[int, ...] | None:
        return self.trees[seq] if self.trees is not None else None

    @property
    def has_trees(self) -> bool:
        return self.trees is not None and any(t is not None for t in self.trees)

    def token_positions(self) -> list[int]:
        """Absolute position of every new token (what RoPE needs), as a list."""
        out: list[int] = []
        for seq, (q, ctx) in enumerate(zip(self.query_lens, self.context_lens, strict=True)):
            tree = self.tree(seq)
            if tree is None:
                out.extend(range(ctx - q, ctx))
            else:
                root = ctx - q
                out.append(root)
                out.extend(root + d for d in tree_depths(tree))
        return out

    def positions(self) -> torch.Tensor:
        """Absolute position of every new token (what RoPE needs)."""
        if self.has_trees:
            return torch.tensor(self.token_positions(), dtype=torch.long, device=self.device)
        parts = [
            torch.arange(ctx - q, ctx, device=self.device)
            for q, ctx in zip(self.query_lens, self.context_lens, strict=True)
        ]
        return torch.cat(parts)


def tree_depths(parents: tuple[int, ...] | list[int]) -> list[int]:
    """Depth of each draft node: 1 for a child of the first query token (parent -1)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def tree_visibility(parents: tuple[int, ...] | list[int]) -> torch.Tensor:
    """[q, q] bool over a tree sequence's query tokens (the first, then the nodes): row a
    sees row b iff b is a itself or an ancestor of a (the first token is everyone's)."""
    n = len(parents) + 1
    seen = torch.zeros((n, n), dtype=torch.bool)
    seen[0, 0] = True
    for i, p in enumerate(parents):
        seen[i + 1] = seen[p + 1]
        seen[i + 1, i + 1] = True
    return seen
