"""GGUF tensor rows to fp32, whole tensors at a time.

The formats a model loads most (F32, F16, BF16, Q8_0, Q4_0, Q4_1) are decoded here in a few
vectorised numpy operations over the whole tensor: the `gguf` package splits each tensor into
groups of rows first, which costs 2 s for SmolLM2's Q4_1 file on the 2-core machine where this
takes a fraction of that. Every other type goes through the `gguf` package. The arithmetic is
the package's (fp32 scales times integer codes, plus the minimum), so the values are the same
bits either way (tests/unit/test_gguf_dequant.py compares them).
"""

from __future__ import annotations

import numpy as np

# Formats stored as plain numbers (not blocks with scales): the only ones a big-endian file
# can hold for us, since a block's fp16 scales would need swapping inside each block.
PLAIN_TYPES = ("F32", "F16", "BF16")


def dequantize_rows(raw: np.ndarray, type_name: str, byte_order: str = "<") -> np.ndarray:
    """fp32 values of `raw` (uint8, one tensor row of the file per line), one row per line.

    Always a new, writable array: `raw` is usually a read-only map of the file."""
    rows = raw.shape[0]
    if type_name == "F32":
        return raw.view(f"{byte_order}f4").astype(np.float32)
    if type_name == "F16":
        return raw.view(f"{byte_order}f2").astype(np.float32)
    if type_name == "BF16":
        wide = raw.view(f"{byte_order}u2").astype(np.uint32) << 16
        return wide.view(np.float32)
    if type_name in _BLOCK_DECODERS:
        width = _BLOCK_BYTES[type_name]
        blocks = raw.reshape(rows, -1, width)
        return _BLOCK_DECODERS[type_name](blocks).reshape(rows, -1)
    import gguf  # the rarer formats: imported here, loading HF checkpoints must not need it

    values = gguf.quants.dequantize(np.asarray(raw), gguf.GGMLQuantizationType[type_name])
    return np.array(values, dtype=np.float32).reshape(rows, -1)


def _scale(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 scale at byte `at` of every block, as fp32 [rows, blocks, 1]."""
    return np.ascontiguousarray(blocks[..., at : at + 2]).view("<f2").astype(np.float32)


def _nibbles(codes: np.ndarray) -> np.ndarray:
    # A block's 16 bytes hold elements 0..15 in their low nibbles and 16..31 in the high ones.
    return np.concatenate((codes & 0x0F, codes >> 4), axis=-1)


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    d, m = _scale(blocks, 0), _scale(blocks, 2)
    return d * _nibbles(blocks[..., 4:]).astype(np.float32) + m


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    d = _scale(blocks, 0)
    return d * (_nibbles(blocks[..., 2:]).astype(np.int8) - np.int8(8)).astype(np.float32)


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    d = _scale(blocks, 0)
    return d * blocks[..., 2:].view(np.int8).astype(np.float32)


_BLOCK_DECODERS = {"Q4_1": _q4_1, "Q4_0": _q4_0, "Q8_0": _q8_0}
_BLOCK_BYTES = {"Q4_1": 20, "Q4_0": 18, "Q8_0": 34}
