"""Streaming token ids out as text, one delta per step, without ever splitting a character.

A byte-level token can end halfway through a multi-byte UTF-8 character (an emoji is often
two or three tokens). Decoding each token alone would show U+FFFD to the user; re-decoding the
whole sequence each step would cost O(n) per token. Instead the token's bytes go through an
incremental UTF-8 decoder, which holds back at most three bytes until their character is whole:
O(1) per token, and the deltas add up to exactly `Tokenizer.decode` of the same ids.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from shared.tokenizer.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Per-request text streamer. Not shared between requests or threads."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        # Skipping is the default because a stream goes to a person, who should not see
        # "<|im_end|>"; the deltas then equal `decode(ids, skip_special_tokens=True)`.
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        # "replace" gives the same U+FFFD placement as a one-shot decode of all the bytes.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._num_tokens = 0

    @property
    def num_tokens(self) -> int:
        """Token ids added so far, skipped special tokens included."""
        return self._num_tokens

    @property
    def has_pending_bytes(self) -> bool:
        """True while the tail of a multi-byte character is still awaited."""
        pending, _ = self._utf8.getstate()
        return bool(pending)

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Feed one id or several; returns the text that became complete (maybe "")."""
        ids = (token_ids,) if isinstance(token_ids, int) else tuple(token_ids)
        # Look every id up before changing any state, so a bad id leaves the stream intact.
        data = [self._tokenizer.token_bytes(i) for i in ids]
        self._num_tokens += len(ids)
        kept = b"".join(d for i, d in zip(ids, data, strict=True) if i not in self._skip)
        return self._utf8.decode(kept) if kept else ""

    def flush(self) -> str:
        """End of stream: whatever bytes are still held back, as U+FFFD if incomplete."""
        return self._utf8.decode(b"", final=True)
