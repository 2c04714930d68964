"""Chained block hashes: the identity of a KV block for prefix reuse and routing.

A full block's hash covers its parent's hash, its own token ids and a salt (the model
fingerprint), so equal hashes mean "same tokens at the same positions after the same
prefix, for the same model". The router and every worker must agree on these bytes, so the
hash is a real, process-independent digest (blake2b truncated to 64 bits), never Python's
randomized ``hash()``.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

_MAX_HASH = (1 << 64) - 1


def block_hash(parent_hash: int | None, token_ids: Sequence[int], salt: bytes) -> int:
    """64-bit hash of one block, chained to ``parent_hash`` (``None`` for the first block)."""
    return _chained(parent_hash, _int64_le(token_ids), salt)


def _chained(parent_hash: int | None, tokens: bytes, salt: bytes) -> int:
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
    digest.update(tokens)
    return int.from_bytes(digest.digest(), "little")


def _int64_le(token_ids: Sequence[int]) -> bytes:
    # The token ids as little-endian int64, the bytes every process hashes. `array`, not
    # numpy: the coordinator hashes prompts for routing and must not load numpy to do it.
    packed = array("q", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int, salt: bytes) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids``; a trailing partial block has none."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tokens = _int64_le(token_ids)
    step = 8 * block_size
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(tokens) - step + 1, step):
        parent = _chained(parent, tokens[start : start + step], salt)
        hashes.append(parent)
    return hashes
