"""Chained block hashes: the identity of a KV block for prefix reuse and routing.

A full block's hash covers its parent's hash, its own token ids and a salt (the model
fingerprint), so equal hashes mean "same tokens at the same positions after the same
prefix, for the same model". The router and every worker must agree on these bytes, so the
hash is a real, process-independent digest (blake2b truncated to 64 bits), never Python's
randomized ``hash()``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

_MAX_HASH = (1 << 64) - 1


def block_hash(parent_hash: int | None, token_ids: Sequence[int], salt: bytes) -> int:
    """64-bit hash of one block, chained to ``parent_hash`` (``None`` for the first block)."""
    digest = hashlib.blake2b(digest_size=8)
    # Length-prefix the salt so no (salt, tokens) pair can mimic another by shifting bytes.
    digest.update(len(salt).to_bytes(4, "little"))
    digest.update(salt)
    if parent_hash is None:
        digest.update(b"\x00")
    else:
        if not 0 <= parent_hash <= _MAX_HASH:
            raise ValueError(f"parent hash {parent_hash} is not an unsigned 64-bit value")
        digest.update(b"\x01" + parent_hash.to_bytes(8, "little"))
    digest.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return int.from_bytes(digest.digest(), "little")


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int, salt: bytes) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids``; a trailing partial block has none."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tokens = np.asarray(token_ids, dtype="<i8")
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size], salt)
        hashes.append(parent)
    return hashes
