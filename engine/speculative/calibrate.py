"""A first measurement of what a step costs by query size, taken before the adaptive controller
has seen any real step: without it the controller would have to guess the price of a verify
step, and a guess pessimistic enough to be safe never lets it try (so never learns) the cheap
multi-token steps a bandwidth-bound CPU actually offers."""

from __future__ import annotations

import time

import torch

from engine.kvcache.block_manager import BlockManager
from engine.kvcache.pool import KVPool
from engine.model.llama import LlamaModel
from kernels.attention_metadata import AttentionMetadata

SIZES = (1, 2, 3, 5, 8, 12, 16, 24, 32, 48, 64)
CONTEXT = 64  # tokens of (scratch) context before the query
REPEATS = 2


def measure_step_costs(
    model: LlamaModel, pool: KVPool, blocks: BlockManager, block_size: int
) -> dict[int, float]:
    """Seconds of forward + logits for a query of n tokens, n in SIZES; {} if no free blocks.

    The scratch blocks are fresh (never hashed into the prefix cache) and freed afterwards, so
    the garbage KV written into them is never read by anyone.
    """
    table = blocks.allocate_fresh(CONTEXT + max(SIZES))
    if table is None:
        return {}
    costs: dict[int, float] = {}
    try:
        for n in SIZES:
            ids = torch.zeros(n, dtype=torch.long, device=model.device)
            best = float("inf")
            for _ in range(REPEATS):
                meta = AttentionMetadata(
                    query_lens=[n],
                    context_lens=[CONTEXT + n],
                    block_tables=[table.block_ids],
                    block_size=block_size,
                    device=model.device,
                )
                start = time.perf_counter()
                # Verify steps run on the decode path: time that path, native or torch.
                model.logits(model.forward_path(ids, meta, pool, decode=True), decode=True)
                best = min(best, time.perf_counter() - start)
            costs[n] = best
    finally:
        blocks.free(table)
    return costs
