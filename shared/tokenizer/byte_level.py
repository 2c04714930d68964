"""The GPT-2 byte-level alphabet: how a byte-level BPE vocabulary spells raw bytes as text.

Every byte gets a printable character, so a token string like "ĠhellÃ¶" stands for the bytes
b" hell\\xc3\\xb6". Tokens can end in the middle of a multi-byte UTF-8 character, which is why
decoding works on bytes (see `token_bytes_table`) and only turns into text at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache


@cache
def byte_to_char() -> dict[int, str]:
    """byte -> the character that spells it. Printable Latin-1 bytes spell themselves."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in printable}
    # Whitespace and control bytes are moved above 255 in byte order, so that no token string
    # contains a literal space or newline (a space becomes "Ġ", a newline "Ċ").
    shifted = (b for b in range(256) if b not in table)
    for offset, b in enumerate(shifted):
        table[b] = chr(256 + offset)
    return table


@cache
def char_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_char().items()}


def token_bytes_table(tokens: Sequence[str]) -> tuple[bytes, ...]:
    """The raw bytes each token stands for, indexed by token id.

    A token spelled outside the byte alphabet (possible for added tokens that a converter
    stored as plain text) stands for its own UTF-8 encoding.
    """
    decode = char_to_byte()
    table: list[bytes] = []
    for token in tokens:
        try:
            table.append(bytes(decode[c] for c in token))
        except KeyError:
            table.append(token.encode("utf-8"))
    return tuple(table)
