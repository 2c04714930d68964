"""The tokenizer a GGUF file describes, read from its own metadata (llama.cpp key names).

Nothing here touches the network: the vocabulary, merges, special ids and chat template all
come from the file, so a model and its tokenizer can never drift apart.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property
from pathlib import Path

from shared.modelfile.gguf_header import GGUF_MAGIC, GGUFFormatError, read_gguf_header


class TokenType(IntEnum):
    """`tokenizer.ggml.token_type` values, as llama.cpp defines them."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


@dataclass(frozen=True)
class GGUFVocab:
    """Everything needed to rebuild the file's tokenizer, and nothing about the weights."""

    path: str
    model: str  # tokenizer.ggml.model, e.g. "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str | None  # tokenizer.ggml.pre: which pre-tokenizer split the merges were learned on
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_token_id: int | None
    eos_token_id: int | None
    unknown_token_id: int | None
    padding_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None
    # SentencePiece models whose encoder prefixes a space: decoding drops it again
    # (llama.cpp's tokenizer.ggml.add_space_prefix).
    add_space_prefix: bool = False

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @cached_property  # a scan of the whole vocabulary, asked for several times at start-up
    def control_token_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.token_types) if t == TokenType.CONTROL)

    @cached_property
    def user_defined_token_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.token_types) if t == TokenType.USER_DEFINED)

    @cached_property
    def fingerprint(self) -> str:
        """sha256 over everything that decides the text <-> ids mapping.

        The path and the chat template are left out on purpose: two copies of one tokenizer
        at different paths must agree, and the template only shapes text before encoding.
        """
        # JSON is an unambiguous encoding of nested lists of strings, and the C encoder makes
        # hashing ~100k entries take milliseconds.
        identity = {
            "model": self.model,
            "pre": self.pre,
            "tokens": self.tokens,
            "token_types": self.token_types,
            "merges": self.merges,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "unknown_token_id": self.unknown_token_id,
            "padding_token_id": self.padding_token_id,
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
        }
        if self.add_space_prefix:  # only when set: the existing fingerprints stay as they are
            identity["add_space_prefix"] = True
        encoded = json.dumps(identity, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(encoded.encode("utf-8", "surrogatepass")).hexdigest()


def read_gguf_vocab(path: str | os.PathLike[str]) -> GGUFVocab:
    """Read the tokenizer metadata of a GGUF file.

    Raises FileNotFoundError for a missing file and ValueError, naming the file, for anything
    that is not a complete GGUF with tokenizer metadata.
    """
    path = str(path)
    if not Path(path).is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    try:
        fields = read_gguf_header(path).fields
    except GGUFFormatError as e:
        raise ValueError(f"could not read GGUF file {path} (truncated or corrupt?): {e}") from e

    model = fields.get("tokenizer.ggml.model")
    tokens = fields.get("tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise ValueError(
            f"{path} has no tokenizer metadata (tokenizer.ggml.model / tokenizer.ggml.tokens "
            "are missing); a tokenizer cannot be built from this file"
        )
    vocab_size = len(tokens)
    token_types = fields.get("tokenizer.ggml.token_type", [TokenType.NORMAL] * vocab_size)
    if len(token_types) != vocab_size:
        raise ValueError(
            f"{path}: tokenizer.ggml.token_type has {len(token_types)} entries "
            f"for {vocab_size} tokens"
        )

    def special_id(key: str) -> int | None:
        value = fields.get(f"tokenizer.ggml.{key}")
        if value is None:
            return None
        if not 0 <= int(value) < vocab_size:
            raise ValueError(f"{path}: tokenizer.ggml.{key}={value} is outside the vocabulary")
        return int(value)

    return GGUFVocab(
        path=path,
        model=str(model),
        pre=fields.get("tokenizer.ggml.pre"),
        tokens=tuple(tokens),
        token_types=tuple(int(t) for t in token_types),
        merges=tuple(fields.get("tokenizer.ggml.merges", ())),
        bos_token_id=special_id("bos_token_id"),
        eos_token_id=special_id("eos_token_id"),
        unknown_token_id=special_id("unknown_token_id"),
        padding_token_id=special_id("padding_token_id"),
        add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(fields.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=fields.get("tokenizer.chat_template"),
    )
