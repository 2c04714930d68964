"""The Triton paged-attention kernel: the engine's attention on CUDA devices.

Each step's sequences are sorted by how many new tokens they bring, once per step in `prepare`:
  1 token        -> split-KV decode (flash-decoding),
  2-16 tokens    -> split-KV verify (speculative k+1 queries, causal among them),
  more           -> chunked-prefill flash attention over the cached prefix.
Every layer first writes the step's K/V into their paged slots, then runs the (at most three)
attention kernels; each writes its own sequences' rows of one shared output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention_kernel import AttentionKernel
from kernels.attention_metadata import AttentionMetadata
from kernels.triton_batch import PagedBatch
from kernels.triton_kv_write import write_kv_slots
from kernels.triton_prefill import chunked_prefill_attention
from kernels.triton_split_kv import (
    MAX_QUERY_TOKENS,
    choose_num_splits,
    device_sm_count,
    split_kv_attention,
)


@dataclass(frozen=True)
class TritonStep:
    """One step's sequences by kernel, as device arrays (built once, used by every layer)."""

    decode: PagedBatch | None
    verify: PagedBatch | None
    prefill: PagedBatch | None


def plan_step(meta: AttentionMetadata) -> TritonStep:
    def subset(keep) -> PagedBatch | None:
        ids = [i for i, q_len in enumerate(meta.query_lens) if keep(q_len)]
        return PagedBatch.from_metadata(meta, ids) if ids else None

    return TritonStep(
        decode=subset(lambda q: q == 1),
        verify=subset(lambda q: 2 <= q <= MAX_QUERY_TOKENS),
        prefill=subset(lambda q: q > MAX_QUERY_TOKENS),
    )


class TritonPagedAttention(AttentionKernel):
    name = "triton"

    def __init__(self, num_splits: int | None = None):
        """`num_splits` fixes the split-KV split count (tests, benchmarks); by default it is
        chosen per step to fill the device's SMs."""
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        self.num_splits = num_splits
        self._sm_counts: dict[torch.device, int] = {}

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.kernel_state["triton"] = plan_step(meta)

    def forward(self, q, k, v, key_cache, value_cache, meta, scale, window=None):
        if window is not None:
            # The kernels attend whole contexts; a window-bounded model runs torch attention.
            raise NotImplementedError("the Triton attention kernels have no sliding window")
        if "triton" not in meta.kernel_state:
            self.prepare(meta)
        step: TritonStep = meta.kernel_state["triton"]
        if q.shape[0] != meta.num_tokens:
            raise ValueError(f"q has {q.shape[0]} tokens, the step has {meta.num_tokens}")
        write_kv_slots(k, v, key_cache, value_cache, meta.slot_blocks, meta.slot_offsets)
        out = torch.empty_like(q)
        for batch in (step.decode, step.verify):
            if batch is not None:
                splits = self._splits(batch, key_cache)
                split_kv_attention(q, key_cache, value_cache, out, batch, scale, splits)
        if step.prefill is not None:
            chunked_prefill_attention(q, key_cache, value_cache, out, step.prefill, scale)
        return out

    def _splits(self, batch: PagedBatch, key_cache: torch.Tensor) -> int:
        if self.num_splits is not None:
            return self.num_splits
        device = key_cache.device
        if device not in self._sm_counts:
            self._sm_counts[device] = device_sm_count(device)
        return choose_num_splits(
            batch.num_seqs, key_cache.shape[2], batch.max_context_len, self._sm_counts[device]
        )
