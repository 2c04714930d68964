"""The plain-ASCII word cache gives exactly the ids of the full `tokenizers` pipeline."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from shared.tokenizer import Tokenizer
from shared.tokenizer.word_cache import WordCache

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(scope="module")
def tok(gguf_path: str) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


def _full(tok: Tokenizer, text: str) -> list[int]:
    return tok._rust.encode(text, add_special_tokens=False).ids


def test_random_text_with_control_tokens_encodes_alike(tok: Tokenizer) -> None:
    # Pieces where the GPT-2 split has its corners: contractions, runs of spaces before a
    # word or a digit, newlines and tabs, punctuation runs, control tokens (whole and cut).
    pieces = [*"abcXYZ019 '\n\t.,!?-_<>|", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    pieces += ["'s", "'ll", "'RE", "  ", "\n\n", " \n ", "<|im_", "12345", "don't", "x  1"]
    rng = random.Random(0)
    assert tok._word_cache is not None
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        assert tok._word_cache.encode(text) == _full(tok, text), repr(text)


def test_real_text_encodes_alike(tok: Tokenizer) -> None:
    lines = [line for line in README.read_text().splitlines() if line.isascii()]
    texts = ["\n".join(lines[i : i + 12]) for i in range(0, len(lines), 12)]
    chat = tok.apply_chat_template(
        [{"role": "system", "content": texts[0]}, {"role": "user", "content": texts[1]}]
    )
    for text in [*texts, chat]:
        assert tok.encode(text) == _full(tok, text)


@pytest.mark.parametrize("text", ["café au lait", "tab\x0bvertical", "line\r\nbreak", "日本語"])
def test_other_text_takes_the_full_tokenizer(tok: Tokenizer, text: str) -> None:
    assert tok._word_cache is not None
    assert tok._word_cache.encode(text) is None
    assert tok.encode(text) == _full(tok, text)


def test_a_full_cache_starts_over_and_stays_right(tok: Tokenizer) -> None:
    calls: list[str] = []

    def tokenize_word(word: str) -> list[int]:
        calls.append(word)
        return [t.id for t in tok._rust.model.tokenize(word)]

    cache = WordCache(tokenize_word, digits_first=True, added_tokens={}, max_words=4)
    text = "one two three four five six one two"
    assert cache.encode(text) == _full(tok, text)
    assert len(cache._words) <= 4
    calls.clear()
    assert cache.encode(" two") == _full(tok, " two")
    assert calls == []  # remembered
