"""SentencePiece-style vocabularies (Gemma, Llama 2, Mistral v0.1): how a piece spells bytes.

A piece writes a space as "▁" and, with byte fallback, a byte outside the vocabulary as
"<0xHH>". Decoding works on bytes, as for byte-level BPE, so a character split over
fallback bytes streams correctly.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SPACE = "\u2581"


def spm_token_bytes_table(tokens: Sequence[str], verbatim: set[int]) -> tuple[bytes, ...]:
    """Bytes per token id; `verbatim` ids (control and added tokens) spell themselves."""
    table: list[bytes] = []
    for i, token in enumerate(tokens):
        byte = _BYTE_PIECE.fullmatch(token)
        if i in verbatim:
            table.append(token.encode("utf-8"))
        elif byte is not None:
            table.append(bytes([int(byte.group(1), 16)]))
        else:
            table.append(token.replace(SPACE, " ").encode("utf-8"))
    return tuple(table)
