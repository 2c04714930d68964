"""A GGUF file's metadata and tensor directory, parsed with `struct` (no numpy, no weights read).

The `gguf` package's reader builds a numpy view per array element: opening the bundled
model's 49k-token vocabulary that way takes about 3 s, where this parser takes a few tens of
milliseconds. Processes that only need the metadata (the coordinator's tokenizer and context
length, a worker's tokenizer) read it here, and loading weights finds each tensor's bytes
through its directory (`engine.model.gguf_file`).

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (versions 2 and 3, either
byte order). Everything comes from an untrusted file, so every length and count is checked
against the bytes actually there before it is used.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from math import prod
from typing import Any

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format of one scalar (8 = string, 9 = array).
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q"}
_SCALAR_FORMATS |= {11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

# ggml tensor types: id -> (name, elements per block, bytes per block), as gguf.constants has
# them (tests/unit/test_gguf_header.py checks the two agree).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF this parser can read: wrong magic, truncated, or corrupt."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str  # ggml type, e.g. "Q4_1"
    shape: tuple[int, ...]  # in file order: ne0 (the contiguous dimension) first
    offset: int  # of its data, from the start of the file


@dataclass(frozen=True)
class GGUFHeader:
    path: str
    version: int
    fields: dict[str, Any]  # key -> str | int | float | bool | list (arrays, nested as lists)
    tensors: tuple[TensorInfo, ...]
    byte_order: str = "<"  # struct's prefix for the file's numbers

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


def read_gguf_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """The metadata and tensor directory of the GGUF at `path`.

    Raises OSError if the file cannot be opened and GGUFFormatError (a ValueError) for
    anything that is not a complete GGUF, including tensor data running past the end of the
    file (an interrupted download).
    """
    path = str(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise GGUFFormatError(f"{path}: {size} bytes is too short for a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            try:
                return _Parser(path, data, size).header()
            except (struct.error, UnicodeDecodeError, OverflowError, MemoryError) as exc:
                raise GGUFFormatError(f"{path}: truncated or corrupt GGUF metadata: {exc}") from exc


class _Parser:
    def __init__(self, path: str, data: mmap.mmap, size: int):
        self.path = path
        self.data = data
        self.size = size
        self.pos = 0
        self.order = "<"
        self.u64 = struct.Struct("<Q")

    def header(self) -> GGUFHeader:
        if self.data[:4] != GGUF_MAGIC:
            raise GGUFFormatError(f"{self.path} is not a GGUF file (it does not start with 'GGUF')")
        (version,) = struct.unpack_from("<I", self.data, 4)
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self.order = ">"
            self.u64 = struct.Struct(">Q")
            (version,) = struct.unpack_from(">I", self.data, 4)
        if version not in SUPPORTED_VERSIONS:
            raise GGUFFormatError(f"{self.path}: GGUF version {version} is not supported")
        self.pos = 8
        tensor_count, kv_count = self._unpack("QQ")
        fields: dict[str, Any] = {}
        for _ in range(self._count(kv_count, 13)):  # key length, type, smallest value
            key = self._string()
            (kind,) = self._unpack("I")
            fields[key] = self._value(kind)
        infos = [self._tensor_info() for _ in range(self._count(tensor_count, 24))]
        alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"{self.path}: general.alignment {alignment!r} is invalid")
        start = -(-self.pos // alignment) * alignment
        tensors = tuple(self._place(start, *info) for info in infos)
        return GGUFHeader(self.path, version, fields, tensors, self.order)

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(self.order + fmt, self.data, self.pos)
        self.pos += struct.calcsize(self.order + fmt)
        return values

    def _count(self, count: int, min_bytes_each: int) -> int:
        # A corrupt count could ask for 2**63 items; none can be smaller than min_bytes_each.
        if count * min_bytes_each > self.size - self.pos:
            raise GGUFFormatError(
                f"{self.path}: truncated or corrupt GGUF metadata ({count} items at offset "
                f"{self.pos} cannot fit in the file)"
            )
        return count

    def _string(self) -> str:
        return self._strings(1)[0]

    def _strings(self, count: int) -> list[str]:
        # The hot loop (a vocabulary is ~100k strings): locals only, one precompiled struct.
        data, size, pos, u64 = self.data, self.size, self.pos, self.u64.unpack_from
        out = []
        for _ in range(count):
            (length,) = u64(data, pos)
            pos += 8
            end = pos + length
            if end > size:
                raise GGUFFormatError(
                    f"{self.path}: truncated or corrupt GGUF metadata (a {length}-byte string "
                    f"at offset {pos} runs past the end of the file)"
                )
            out.append(data[pos:end].decode("utf-8"))
            pos = end
        self.pos = pos
        return out

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item_kind, count = self._unpack("IQ")
            if item_kind in _SCALAR_FORMATS:
                fmt = _SCALAR_FORMATS[item_kind]
                self._count(count, struct.calcsize(fmt))
                return list(self._unpack(f"{count}{fmt}"))
            if item_kind == _STRING:
                return self._strings(self._count(count, 8))
            if item_kind == _ARRAY:
                return [self._value(_ARRAY) for _ in range(self._count(count, 12))]
            raise GGUFFormatError(f"{self.path}: unknown GGUF value type {item_kind}")
        if kind in _SCALAR_FORMATS:
            return self._unpack(_SCALAR_FORMATS[kind])[0]
        raise GGUFFormatError(f"{self.path}: unknown GGUF value type {kind}")

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        (n_dims,) = self._unpack("I")
        shape = self._unpack(f"{self._count(n_dims, 8)}Q")
        kind, offset = self._unpack("IQ")
        return name, tuple(shape), kind, offset

    def _place(self, start: int, name: str, shape: tuple[int, ...], kind: int, offset: int):
        if kind not in GGML_TYPES:
            raise GGUFFormatError(f"{self.path}: tensor '{name}' has unknown ggml type {kind}")
        type_name, block, block_bytes = GGML_TYPES[kind]
        elements = prod(shape)
        if elements % block:
            raise GGUFFormatError(
                f"{self.path}: tensor '{name}' has {elements} elements, not a whole number of "
                f"{type_name} blocks of {block}"
            )
        end = start + offset + elements // block * block_bytes
        if end > self.size:
            raise GGUFFormatError(
                f"{self.path}: truncated GGUF: tensor '{name}' needs bytes up to {end}, the "
                f"file has {self.size}"
            )
        return TensorInfo(name, type_name, shape, start + offset)


# The same table by type name (what TensorInfo carries).
GGML_TYPES_BY_NAME: dict[str, tuple[int, int, int]] = {
    name: (kind, block, block_bytes) for kind, (name, block, block_bytes) in GGML_TYPES.items()
}
