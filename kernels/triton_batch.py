"""The per-step device arrays the Triton attention kernels index, and their input checks.

`AttentionMetadata` holds Python lists (what the scheduler produces); kernels need int32 device
tensors. A `PagedBatch` is one subset of a step's sequences (its decode rows, its verify rows or
its prefill chunks) in that form, built once per step and reused by every layer. The subset
keeps each sequence's flat query offset, so kernels read `q` and write `out` in place without
gathering the subset's tokens first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention_metadata import AttentionMetadata

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class PagedBatch:
    query_start: torch.Tensor  # [seqs] int32: flat index of each sequence's first new token
    query_len: torch.Tensor  # [seqs] int32
    context_len: torch.Tensor  # [seqs] int32: cached prefix + new tokens
    block_table: torch.Tensor  # [seqs, max_blocks] int32, padded with block 0
    # Per new token of the batch, in order: its sequence (row of the arrays above) and its
    # index among that sequence's new tokens. Lets per-token grids skip padded query slots.
    token_seq: torch.Tensor  # [batch_tokens] int32
    token_index: torch.Tensor  # [batch_tokens] int32
    block_size: int
    max_query_len: int
    max_context_len: int

    @property
    def num_seqs(self) -> int:
        return int(self.query_len.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.token_seq.shape[0])

    @classmethod
    def build(
        cls,
        query_starts: list[int],
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
    ) -> PagedBatch:
        if not query_lens:
            raise ValueError("a PagedBatch needs at least one sequence")
        blocks_needed = [(ctx + block_size - 1) // block_size for ctx in context_lens]
        width = max(blocks_needed)
        table = torch.zeros((len(query_lens), width), dtype=torch.int32)
        for row, (used, blocks) in enumerate(zip(blocks_needed, block_tables, strict=True)):
            if len(blocks) < used:
                raise ValueError(f"sequence {row}: {len(blocks)} blocks cannot hold its context")
            table[row, :used] = torch.tensor(blocks[:used], dtype=torch.int32)

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        token_seq = [row for row, q_len in enumerate(query_lens) for _ in range(q_len)]
        token_index = [i for q_len in query_lens for i in range(q_len)]
        return cls(
            token_seq=ints(token_seq),
            token_index=ints(token_index),
            query_start=ints(query_starts),
            query_len=ints(query_lens),
            context_len=ints(context_lens),
            block_table=table.to(device),
            block_size=block_size,
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
        )

    @classmethod
    def from_metadata(cls, meta: AttentionMetadata, seq_ids: list[int]) -> PagedBatch:
        starts = [0]
        for q_len in meta.query_lens:
            starts.append(starts[-1] + q_len)
        return cls.build(
            query_starts=[starts[i] for i in seq_ids],
            query_lens=[meta.query_lens[i] for i in seq_ids],
            context_lens=[meta.context_lens[i] for i in seq_ids],
            block_tables=[meta.block_tables[i] for i in seq_ids],
            block_size=meta.block_size,
            device=meta.device,
        )


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Both caches `[num_blocks, block_size, kv_heads, head_dim]`, same shape, dtype and device,
    head_dim contiguous (block-major pool views are strided in every other dimension)."""
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4:
            raise ValueError(
                f"{name} must be [num_blocks, block_size, kv_heads, head_dim], got "
                f"shape {tuple(cache.shape)}"
            )
        if cache.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous head_dim, got strides {cache.stride()}")
        if cache.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype {cache.dtype} is not one of {SUPPORTED_DTYPES}")
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError(
            f"key/value caches differ: {tuple(key_cache.shape)} {key_cache.dtype} vs "
            f"{tuple(value_cache.shape)} {value_cache.dtype}"
        )
    if key_cache.device != value_cache.device:
        raise ValueError(f"caches on {key_cache.device} and {value_cache.device}")


def check_attention_inputs(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    batch: PagedBatch,
) -> int:
    """Validate one kernel call's tensors; returns the GQA group size (query heads per KV head)."""
    check_cache_pair(key_cache, value_cache)
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(
            f"q must be [tokens, heads, head_dim] with contiguous head_dim, got "
            f"shape {tuple(q.shape)} strides {q.stride()}"
        )
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} must match q {tuple(q.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not one of {SUPPORTED_DTYPES}")
    _, block_size, kv_heads, head_dim = key_cache.shape
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    if q.shape[1] % kv_heads:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {kv_heads} KV heads")
    if batch.block_size != block_size:
        raise ValueError(f"batch block_size {batch.block_size} != cache block_size {block_size}")
    if q.device != key_cache.device or batch.block_table.device != q.device:
        raise ValueError(
            f"q on {q.device}, cache on {key_cache.device}, "
            f"block table on {batch.block_table.device}"
        )
    return q.shape[1] // kv_heads


def dot_in_fp32(*tensors: torch.Tensor) -> bool:
    """Whether the kernels' matmuls should run on fp32 operands in IEEE precision.

    Half-precision operands on a GPU go to the tensor cores as they are. fp32 operands would be
    rounded to tf32 by default (too lossy for an exact-verify engine), and under the CPU
    interpreter (tensors on the CPU) half-precision `tl.dot` is not computed correctly, so both
    cases upcast and ask for IEEE fp32.
    """
    on_gpu = all(t.device.type == "cuda" for t in tensors)
    half = all(t.dtype in (torch.float16, torch.bfloat16) for t in tensors)
    return not (on_gpu and half)
