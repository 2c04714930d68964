"""Model files: the HF folder loader, and clear errors for files we cannot run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model.gguf_file import read_gguf
from engine.model.llama import LlamaModel
from engine.model.loader import read_checkpoint
from engine.model.tiny import tiny_checkpoint, write_hf_folder
from shared.modelfile.config import ModelFileError
from tests.reference import dense_logits


def test_hf_folder_round_trip(tmp_path):
    original = tiny_checkpoint(seed=3)
    folder = write_hf_folder(original, tmp_path / "tiny")
    loaded = read_checkpoint(folder)
    assert loaded.config == original.config
    ids = [5, 9, 200, 7, 3]
    first, second = LlamaModel(original), LlamaModel(loaded)
    # Every row count: a decode step's one row and a verify step's few take other GEMM calls
    # than a prompt's, and each must give the same bits wherever the file put the weights.
    for n in range(1, len(ids) + 1):
        assert torch.equal(dense_logits(first, ids[:n]), dense_logits(second, ids[:n])), n


def test_missing_file_is_named(tmp_path):
    path = tmp_path / "nope.gguf"
    with pytest.raises(ModelFileError, match="nope.gguf.*does not exist"):
        read_checkpoint(path)


def test_truncated_gguf_is_refused(tmp_path, gguf_path):
    truncated = tmp_path / "cut.gguf"
    with open(gguf_path, "rb") as f:
        truncated.write_bytes(f.read(20_000_000))
    with pytest.raises(ModelFileError, match="cut.gguf.*(truncated|corrupt)"):
        read_gguf(truncated)


def _write_gguf(path, arch: str, tensor_dtype=np.float32, extra: dict | None = None):
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=tensor_dtype))
    for name, value in (extra or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "gpt2.gguf"
    _write_gguf(path, "gpt2")
    with pytest.raises(ModelFileError, match="unsupported architecture 'gpt2'"):
        read_gguf(path)


def test_unsupported_tensor_type_is_named(tmp_path):
    path = tmp_path / "i32.gguf"
    _write_gguf(path, "llama", tensor_dtype=np.int32)
    with pytest.raises(ModelFileError, match="token_embd.weight.*unsupported type I32"):
        read_gguf(path)


def test_not_a_model(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(ModelFileError, match="not a GGUF"):
        read_checkpoint(path)


def test_hf_folder_without_config(tmp_path):
    with pytest.raises(ModelFileError, match="config.json"):
        read_checkpoint(tmp_path)


def test_rope_factors_that_do_not_fit_the_heads_are_refused(tmp_path):
    """A Llama 3.1+ GGUF carries its RoPE blend as a `rope_freqs` tensor, one divisor per
    rotated pair (served: tests/unit/test_families_gguf.py); a tensor of another length
    describes some other model, so it is refused rather than broadcast."""
    path = tmp_path / "llama31.gguf"
    _write_gguf(path, "llama", extra={"rope_freqs.weight": np.ones(3, dtype=np.float32)})
    with pytest.raises(ModelFileError, match="rope_freqs has 3 factors for 2 rotated pairs"):
        read_gguf(path)


def test_a_quantized_tensor_in_a_big_endian_file_is_refused(tmp_path):
    """A block's fp16 scales would need swapping inside each block; rather than read them
    wrong, the file is refused and the tensor named."""
    import gguf

    path = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    blocks = np.zeros((4, 34), dtype=np.uint8)
    writer.add_tensor("token_embd.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match="token_embd.weight' is Q8_0 in a big-endian GGUF"):
        read_gguf(path)
