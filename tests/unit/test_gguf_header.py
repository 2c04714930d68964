"""Our struct-based GGUF metadata parser reads what the `gguf` package reads, and refuses the rest.

The package is the reference (it wrote the files and reads them); ours must agree on every
field and tensor, in both byte orders, and turn every truncation or corrupt count into a
GGUFFormatError naming the file instead of another exception or a hang.
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from shared.modelfile.gguf_header import GGML_TYPES, GGUFFormatError, read_gguf_header


def _reference(path: Path | str) -> tuple[dict, list[tuple]]:
    reader = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = [
        (t.name, t.tensor_type.name, tuple(int(d) for d in t.shape), int(t.data_offset))
        for t in reader.tensors
    ]
    return fields, tensors


def _ours(path: Path | str) -> tuple[dict, list[tuple]]:
    header = read_gguf_header(path)
    return header.fields, [(t.name, t.type_name, t.shape, t.offset) for t in header.tensors]


def _write(path: Path, endian: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> Path:
    """A small file with every kind of value: scalars, strings, arrays, nested arrays."""
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    writer.add_uint8("t.u8", 7)
    writer.add_int16("t.i16", -3)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float32("t.f32", 0.5)
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.text", "héllo ✓")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.words", ["a", "", "ü"])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_tensor("w", np.arange(64, dtype=np.float32))
    writer.add_tensor("v", np.zeros((2, 32), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_bundled_model_reads_the_same(gguf_path):
    assert _ours(gguf_path) == _reference(gguf_path)


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_value_type_reads_the_same(tmp_path, endian):
    path = _write(tmp_path / "all.gguf", endian)
    fields, tensors = _ours(path)
    ref_fields, ref_tensors = _reference(path)
    # The package's contents() flattens an array of arrays; the format (and we) keep it nested.
    assert ref_fields.pop("t.nested") == [1, 2, 3]
    assert {k: v for k, v in fields.items() if k != "t.nested"} == ref_fields
    assert tensors == ref_tensors
    assert fields["t.text"] == "héllo ✓" and fields["t.bool"] is True
    assert fields["t.nested"] == [[1, 2], [3]] and fields["t.words"] == ["a", "", "ü"]
    assert fields["t.i64"] == -(2**40) and fields["t.u32"] == 4_000_000_000
    assert [t[:3] for t in tensors] == [("w", "F32", (64,)), ("v", "F16", (32, 2))]


def test_type_table_matches_the_gguf_package():
    for type_id, (name, block, block_bytes) in GGML_TYPES.items():
        qtype = gguf.GGMLQuantizationType(type_id)
        assert qtype.name == name
        assert gguf.GGML_QUANT_SIZES[qtype] == (block, block_bytes), name


def test_every_truncation_is_a_format_error(tmp_path):
    whole = _write(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    for size in range(len(whole)):
        cut.write_bytes(whole[:size])
        with pytest.raises(GGUFFormatError, match="cut.gguf"):
            read_gguf_header(cut)


def test_a_corrupt_count_is_refused_at_once(tmp_path):
    data = bytearray(_write(tmp_path / "ok.gguf").read_bytes())
    struct.pack_into("<Q", data, 16, 2**62)  # the key/value count
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFFormatError, match="cannot fit in the file"):
        read_gguf_header(bad)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_bytes(b"hello, this is not a model file at all")
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        read_gguf_header(path)
