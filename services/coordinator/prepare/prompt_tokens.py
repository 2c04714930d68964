"""Tokenizing rendered chat prompts without re-encoding what a conversation repeats.

Every turn of a chat resends the whole conversation, so most of its rendered prompt is text
the coordinator encoded on the previous turn. The tokenizer matches control tokens
(`<|im_start|>`, `<|im_end|>`, ...) before anything else and encodes the text between them
on its own, so a prompt's ids are the ids of its pieces split just before each control token,
concatenated. Pieces are remembered (least recently used first out, bounded in characters);
a turn encodes only the pieces it adds.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict

from shared.tokenizer.tokenizer import Tokenizer

DEFAULT_MAX_CHARS = 4 << 20  # about what the cached ids and their text take, in characters


class PromptTokens:
    def __init__(self, tokenizer: Tokenizer, max_chars: int = DEFAULT_MAX_CHARS):
        if max_chars < 1:
            raise ValueError("max_chars must be at least 1")
        self.tokenizer = tokenizer
        self.max_chars = max_chars
        specials = sorted(
            (tokenizer.id_to_token(i) for i in tokenizer.special_token_ids), key=len, reverse=True
        )
        # A lookahead split: each piece starts with its control token (the first may not).
        self._split = (
            re.compile("(?=" + "|".join(map(re.escape, specials)) + ")") if specials else None
        )
        self._lock = threading.Lock()  # a large prompt is prepared on a worker thread
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._chars = 0
        self.hits = 0
        self.misses = 0

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self.tokenizer.encode(text)
        ids: list[int] = []
        for piece in self._split.split(text):
            if piece:
                ids += self._piece(piece)
        return ids

    def _piece(self, piece: str) -> list[int]:
        with self._lock:
            cached = self._pieces.get(piece)
            if cached is not None:
                self.hits += 1
                self._pieces.move_to_end(piece)
                return cached
            self.misses += 1
        ids = self.tokenizer.encode(piece)  # outside the lock: the slow part
        if len(piece) > self.max_chars:
            return ids
        with self._lock:
            if piece not in self._pieces:
                self._pieces[piece] = ids
                self._chars += len(piece)
            while self._chars > self.max_chars:
                old, _ = self._pieces.popitem(last=False)
                self._chars -= len(old)
        return ids
