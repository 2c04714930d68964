"""Our whole-tensor GGUF decoding gives the `gguf` package's values, bit for bit, per format."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine.model.gguf_dequant import dequantize_rows
from shared.modelfile.gguf_header import GGML_TYPES_BY_NAME


def _random_rows(type_name: str, rows: int, blocks: int, seed: int) -> np.ndarray:
    """Random codes with finite fp16 scales where a block format keeps them."""
    _, _, block_bytes = GGML_TYPES_BY_NAME[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks, block_bytes), dtype=np.uint8)
    if type_name in ("F32", "F16", "BF16"):
        values = rng.standard_normal((rows, blocks)).astype(np.float32)
        if type_name == "F32":
            raw = values.view(np.uint8)
        elif type_name == "F16":
            raw = values.astype(np.float16).view(np.uint8)
        else:
            raw = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return raw.reshape(rows, -1)
    scales = rng.uniform(-0.1, 0.1, size=(rows, blocks, 2)).astype(np.float16)
    raw[..., :2] = scales[..., :1].view(np.uint8)
    if type_name == "Q4_1":  # d, then the block's minimum m
        raw[..., 2:4] = scales[..., 1:].view(np.uint8)
    if type_name == "Q6_K":  # d sits at the end of a K block
        raw[..., -2:] = scales[..., :1].view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q6_K"])
def test_rows_decode_to_the_gguf_packages_bits(type_name):
    raw = _random_rows(type_name, rows=5, blocks=3, seed=len(type_name))
    ours = dequantize_rows(raw, type_name)
    theirs = np.asarray(
        gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]), dtype=np.float32
    ).reshape(ours.shape)
    assert ours.dtype == np.float32 and ours.flags.writeable
    assert np.isfinite(ours).all()
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_big_endian_plain_rows_are_swapped():
    values = np.array([[1.5, -2.25, 3.0, 0.125]], dtype=np.float32)
    raw = values.astype(">f4").view(np.uint8).reshape(1, -1)
    assert np.array_equal(dequantize_rows(raw, "F32", ">"), values)
    raw16 = values.astype(">f2").view(np.uint8).reshape(1, -1)
    assert np.array_equal(dequantize_rows(raw16, "F16", ">"), values)
