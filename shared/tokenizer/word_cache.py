"""Encoding plain ASCII text through a cache of its words: the coordinator's hot path.

Why: a fresh ~300-token message took 0.25 ms to encode through `tokenizers` with warm CPU
caches and 0.65 ms with the cold ones a request meets, most of it the regex pre-tokenizer:
the largest single part of the coordinator's time before its Prefill RPC leaves. Chat text is
mostly words seen before, so cutting it with Python's own regex and looking each word's ids
up costs about a third.

Only where the cut is certain to be the same: byte-level BPE with the GPT-2 split (with or
without each digit isolated first), over text made only of printable ASCII, tab and newline,
where letters, digits and whitespace mean one thing in every regex engine. Anything else
returns None and goes through `tokenizers` (tests compare both on random and real text).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping, Sequence

# Outside printable ASCII, tab and newline the two engines' character classes may differ
# (Unicode letters, other whitespace): such text takes the `tokenizers` path.
_NOT_PLAIN = re.compile(r"[^\x20-\x7e\t\n]")

# GPT-2's split, written for plain ASCII: contractions, letter runs, digit runs, other
# punctuation runs (each with one optional leading space), trailing whitespace, whitespace.
_GPT2_SPLIT = re.compile(
    r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^ \t\nA-Za-z0-9]+"
    r"|[ \t\n]+(?![^ \t\n])|[ \t\n]+"
)
_ONE_DIGIT = re.compile(r"([0-9])")

# The byte-level alphabet on ASCII: printable bytes are themselves, these three are shifted.
_BYTE_LEVEL = str.maketrans({" ": "\u0120", "\n": "\u010a", "\t": "\u0109"})

MAX_WORDS = 1 << 17  # remembered words (each a short string and a few ids)
MAX_WORD_CHARS = 64  # longer runs are encoded each time, not remembered


class WordCache:
    def __init__(
        self,
        tokenize_word: Callable[[str], Sequence[int]],
        digits_first: bool,
        added_tokens: Mapping[str, int],
        max_words: int = MAX_WORDS,
    ):
        """`tokenize_word`: the BPE model's ids for one word in the byte-level alphabet;
        `digits_first`: each digit is its own chunk before the GPT-2 split (SmolLM, StarCoder);
        `added_tokens`: control and user-defined tokens, matched in the text before anything."""
        self._tokenize_word = tokenize_word
        self._digits_first = digits_first
        self._added = dict(added_tokens)
        # Longest first: at one position the longest added token wins, as in `tokenizers`.
        names = sorted(self._added, key=len, reverse=True)
        self._added_split = re.compile("|".join(map(re.escape, names))) if names else None
        self._max_words = max_words
        self._words: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()  # long prompts are prepared on worker threads

    def encode(self, text: str) -> list[int] | None:
        """The ids of `text`, or None where it is not plain ASCII (use the full tokenizer)."""
        if not text.isascii() or _NOT_PLAIN.search(text):
            return None
        ids: list[int] = []
        if self._added_split is None:
            self._encode_text(text, ids)
            return ids
        at = 0
        for match in self._added_split.finditer(text):
            self._encode_text(text[at : match.start()], ids)
            ids.append(self._added[match.group()])
            at = match.end()
        self._encode_text(text[at:], ids)
        return ids

    def _encode_text(self, text: str, ids: list[int]) -> None:
        if not text:
            return
        if not self._digits_first:
            self._encode_words(_GPT2_SPLIT.findall(text), ids)
            return
        for i, part in enumerate(_ONE_DIGIT.split(text)):
            if i % 2:  # a digit, its own chunk
                self._encode_words((part,), ids)
            elif part:
                self._encode_words(_GPT2_SPLIT.findall(part), ids)

    def _encode_words(self, words: Sequence[str], ids: list[int]) -> None:
        known = self._words
        for word in words:
            got = known.get(word)
            if got is None:
                got = tuple(self._tokenize_word(word.translate(_BYTE_LEVEL)))
                if len(word) <= MAX_WORD_CHARS:
                    self._remember(word, got)
            ids += got

    def _remember(self, word: str, got: tuple[int, ...]) -> None:
        with self._lock:
            if len(self._words) >= self._max_words:
                self._words.clear()  # a new vocabulary of words refills it in a few turns
            self._words[word] = got
