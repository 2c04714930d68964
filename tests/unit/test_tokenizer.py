"""The GGUF-built tokenizer against transformers loading the same file, offline."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.tokenizer import IncrementalDetokenizer, Tokenizer, read_gguf_vocab
from shared.tokenizer.byte_level import byte_to_char
from shared.tokenizer.chat_template import ChatTemplate

pytestmark = pytest.mark.real_model

CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you're right; we've seen they'll say he'd do it. DON'T SHOUT",
    "Café naïve façade résumé: Ångström in Zürich, São Paulo, Kraków, Reykjavík",
    "e\u0301 is e + combining acute, é is precomposed",
    "你好，世界！今天天气很好。",
    "日本語のテキスト、カタカナとひらがな",
    "한국어 문장입니다",
    "Привет, мир! Γειά σου κόσμε. مرحبا بالعالم. नमस्ते दुनिया",
    "I ❤️ pizza 🍕🍕 and 🐍",
    "family 👨‍👩‍👧‍👦, flag 🏳️‍🌈, thumbs 👍🏽, astronaut 🧑🏿‍🚀",
    "In 2024 we paid 1,000,000 for 3.14159 units at -42 degrees, 0x1F, 1e-9",
    "call +1 (555) 123-4567 on 12/31/1999",
    "def square(x):\n    return x ** 2  # the square\n",
    "for (int i = 0; i < n; ++i) { total += a[i]; }",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    '<div class="note">&amp; fish</div>',
    "",
    " ",
    "  ",
    "   leading spaces",
    "trailing spaces   ",
    "multiple     spaces     here",
    "tabs\tand\t\tmore tabs",
    "new\nlines\n\n\nmany",
    "windows\r\nline\r\nendings\r\n",
    "\n",
    "\t",
    " \n \n ",
    "mixed \t\n whitespace",
    "non\u00a0breaking and\u3000ideographic and zero\u200bwidth",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<|im_end|><|im_end|>",
    "a <|im_start|> b",
    "<jupyter_code>print('x')<jupyter_output>",
    "<|im_start near miss <|im_end |>",
]

# Where the file's "smollm" split (each digit isolated first, as in llama.cpp) differs from the
# plain GPT-2 split that transformers' GGUF loader applies: whitespace runs and non-ASCII
# numerals before or between digits.
DIGIT_CASES = [
    "x  1",
    "[\n    1,\n    2\n]",
    "a\n 42",
    "  3.14",
    "\t 7 and  8",
    "½ ² ³ Ⅻ ٣ ²³ x²",
]

# llama.cpp's regexes for tokenizer.ggml.pre = "smollm", applied one after the other.
_SMOLLM_SPLITS = [
    regex.compile(r"\p{N}"),
    regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"),
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Arr, ahoy!"},
        {"role": "user", "content": "Where is the treasure? 🗺️"},
    ],
    [
        {"role": "user", "content": "Translate: chat"},
        {"role": "assistant", "content": "猫 — wait, that is Japanese for cat."},
        {"role": "user", "content": "  spaces\n\tand tabs  "},
    ],
]


@pytest.fixture(scope="module")
def tok(gguf_path: str) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf(gguf_path: str):
    transformers = pytest.importorskip("transformers")
    path = Path(gguf_path)
    return transformers.AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )


def _smollm_reference_ids(hf, text: str) -> list[int]:
    """llama.cpp's split (regex module) followed by transformers' own BPE model."""
    specials = sorted((t.content for t in hf.added_tokens_decoder.values()), key=len, reverse=True)
    segments = regex.split("(" + "|".join(map(regex.escape, specials)) + ")", text)
    alphabet = byte_to_char()
    ids: list[int] = []
    for segment in segments:
        if segment in specials:
            ids.append(hf.convert_tokens_to_ids(segment))
            continue
        pieces = [segment]
        for pattern in _SMOLLM_SPLITS:
            pieces = [p for piece in pieces for p in _split_keeping_gaps(pattern, piece)]
        for piece in pieces:
            spelled = "".join(alphabet[b] for b in piece.encode("utf-8"))
            ids.extend(t.id for t in hf.backend_tokenizer.model.tokenize(spelled))
    return ids


def _split_keeping_gaps(pattern: regex.Pattern, text: str) -> list[str]:
    pieces, last = [], 0
    for match in pattern.finditer(text):
        pieces += [text[last : match.start()], match.group()]
        last = match.end()
    return [p for p in [*pieces, text[last:]] if p]


# -- metadata and identity ------------------------------------------------------------------


def test_metadata_comes_from_the_file(tok: Tokenizer) -> None:
    vocab = tok.vocab
    assert (vocab.model, vocab.pre, tok.vocab_size) == ("gpt2", "smollm", 49152)
    assert len(vocab.merges) == 48900
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert vocab.tokens[tok.eos_token_id] == "<|im_end|>"
    assert vocab.add_bos_token is False
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template
    assert tok.special_token_ids == frozenset(range(17))
    assert tok.stop_token_ids == {tok.eos_token_id, tok.token_to_id("<|endoftext|>")}


def test_fingerprint_is_stable_and_sensitive(tok: Tokenizer) -> None:
    # Pinned: a change here means processes built from different code no longer agree on it.
    assert tok.fingerprint == "1306e1d7bd63dea5d9d4656fbe3291a4153ec1d1a58d575a5610f297efe51a10"
    vocab = tok.vocab
    assert dataclasses.replace(vocab, path="/elsewhere.gguf").fingerprint == tok.fingerprint
    swapped = (vocab.merges[1], vocab.merges[0], *vocab.merges[2:])
    changes = [
        dataclasses.replace(vocab, merges=swapped),
        dataclasses.replace(vocab, tokens=(*vocab.tokens[:-1], "zzz")),
        dataclasses.replace(vocab, eos_token_id=0),
        dataclasses.replace(vocab, pre="gpt2"),
    ]
    assert len({v.fingerprint for v in changes} | {tok.fingerprint}) == len(changes) + 1


# -- encoding -------------------------------------------------------------------------------


@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_transformers(tok: Tokenizer, hf, text: str) -> None:
    assert tok.encode(text) == hf.encode(text, add_special_tokens=False)
    assert tok.encode(text, add_special_tokens=True) == hf.encode(text)


@pytest.mark.parametrize("text", CORPUS + DIGIT_CASES)
def test_encode_matches_llama_cpp_split(tok: Tokenizer, hf, text: str) -> None:
    assert tok.encode(text) == _smollm_reference_ids(hf, text)


def test_digits_are_split_off_whitespace(tok: Tokenizer) -> None:
    ids = tok.encode("x  1")
    assert [tok.id_to_token(i) for i in ids] == ["x", "ĠĠ", "1"]


def test_special_tokens_are_single_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.token_to_id("<|im_start|>") == 1
    assert ids[-1] == tok.eos_token_id
    assert 1 not in tok.encode("<|im_start")


def test_encode_rejects_non_text(tok: Tokenizer) -> None:
    with pytest.raises(TypeError, match="str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]


# -- decoding -------------------------------------------------------------------------------


@pytest.mark.parametrize("text", CORPUS + DIGIT_CASES)
def test_decode_round_trips(tok: Tokenizer, hf, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text == hf.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_decode_of_a_split_character_uses_replacement(tok: Tokenizer, hf) -> None:
    ids = tok.encode("🍕")
    assert len(ids) > 1
    assert tok.decode(ids[:1]) == hf.decode(ids[:1]) == "\ufffd"


def test_decode_rejects_ids_outside_the_vocabulary(tok: Tokenizer) -> None:
    for bad in (-1, tok.vocab_size):
        with pytest.raises(ValueError, match=f"token id {bad} is outside"):
            tok.decode([5, bad])


# -- chat template --------------------------------------------------------------------------


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf, conversation: list[dict], add_generation_prompt: bool
) -> None:
    expected = hf.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tok.apply_chat_template(conversation, add_generation_prompt) == expected


def test_text_parts_are_flattened(tok: Tokenizer) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    flat = tok.apply_chat_template([{"role": "user", "content": "first\nsecond"}])
    assert tok.apply_chat_template([{"role": "user", "content": parts}]) == flat


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "must not be empty"),
        ([{"content": "no role"}], r"messages\[0\] needs a string 'role'"),
        ([{"role": "user", "content": 42}], "content must be a string or a list"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "'image_url' is not supported",
        ),
    ],
)
def test_malformed_messages_are_refused(tok: Tokenizer, messages: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tok.apply_chat_template(messages)


def test_template_errors_and_sandbox(tok: Tokenizer) -> None:
    refusing = ChatTemplate(
        "{{ raise_exception('roles must alternate') }}", bos_token="", eos_token="", origin="t"
    )
    with pytest.raises(ValueError, match="roles must alternate"):
        refusing.render([{"role": "user", "content": "x"}])
    messages = [{"role": "user", "content": "x"}]
    mutating = ChatTemplate("{{ messages.append(1) }}", bos_token="", eos_token="", origin="t")
    with pytest.raises(ValueError, match="rejected"):
        mutating.render(messages)
    assert messages == [{"role": "user", "content": "x"}]
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}", bos_token="", eos_token="", origin="t")


# -- streaming detokenizer ------------------------------------------------------------------


@pytest.mark.parametrize("text", CORPUS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_detokenizer_deltas_add_up(tok: Tokenizer, text: str, skip_special_tokens: bool) -> None:
    ids = tok.encode(text)
    expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    one_by_one = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    deltas = [one_by_one.add(i) for i in ids] + [one_by_one.flush()]
    assert "".join(deltas) == expected
    if "\ufffd" not in expected:
        assert not any("\ufffd" in d for d in deltas)
    in_threes = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    chunks = [in_threes.add(ids[i : i + 3]) for i in range(0, len(ids), 3)]
    assert "".join(chunks) + in_threes.flush() == expected
    assert one_by_one.num_tokens == in_threes.num_tokens == len(ids)


def test_detokenizer_holds_back_a_partial_character(tok: Tokenizer) -> None:
    ids = tok.encode("a🍕")
    stream = IncrementalDetokenizer(tok)
    assert stream.add(ids[0]) == "a"
    held = [stream.add(i) for i in ids[1:-1]]
    assert held == [""] * len(held) and stream.has_pending_bytes
    assert stream.add(ids[-1]) == "🍕" and not stream.has_pending_bytes
    cut = IncrementalDetokenizer(tok)
    assert cut.add(ids[:2]) == "a" and cut.flush() == "\ufffd"


def test_detokenizer_rejects_a_bad_id_without_losing_state(tok: Tokenizer) -> None:
    ids = tok.encode("🍕")
    stream = IncrementalDetokenizer(tok)
    stream.add(ids[0])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        stream.add([ids[1], tok.vocab_size])
    assert stream.num_tokens == 1
    assert "".join(stream.add(i) for i in ids[1:]) == "🍕"


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_detokenizer_matches_decode_on_arbitrary_ids(
    tok: Tokenizer, hf, data: st.DataObject
) -> None:
    # Single-byte tokens (ids 17..251 in this vocabulary) make invalid UTF-8 far more often than
    # random vocabulary picks would.
    any_id = st.integers(0, tok.vocab_size - 1)
    ids = data.draw(st.lists(st.one_of(st.integers(17, 251), any_id), max_size=40))
    skip = data.draw(st.booleans())
    stream = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    streamed = "".join(stream.add(i) for i in ids) + stream.flush()
    assert streamed == tok.decode(ids, skip_special_tokens=skip)
    assert streamed == hf.decode(ids, skip_special_tokens=skip)


# -- errors ---------------------------------------------------------------------------------


def _write_gguf(path: Path, keys: dict[str, object]) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in keys.items():
        writer.add_key_value(key, value, _gguf_type(value))
    writer.add_tensor("w", np.zeros(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_type(value: object) -> gguf.GGUFValueType:
    if isinstance(value, bool):
        return gguf.GGUFValueType.BOOL
    if isinstance(value, int):
        return gguf.GGUFValueType.UINT32
    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    return gguf.GGUFValueType.ARRAY


def _tiny_bpe_keys(**overrides: object) -> dict[str, object]:
    alphabet = list(byte_to_char().values())
    keys: dict[str, object] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": ["<s>", "</s>", *alphabet, "ab"],
        "tokenizer.ggml.token_type": [3, 3] + [1] * (len(alphabet) + 1),
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
    }
    keys.update(overrides)
    return keys


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nothing.gguf"):
        Tokenizer.from_gguf(tmp_path / "nothing.gguf")


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "notes.gguf"
    path.write_text("hello")
    with pytest.raises(ValueError, match="notes.gguf is not a GGUF file"):
        Tokenizer.from_gguf(path)


def test_truncated_in_metadata(gguf_path: str, tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    with open(gguf_path, "rb") as src:
        path.write_bytes(src.read(4096))  # ends inside the token list
    with pytest.raises(ValueError, match=r"could not read GGUF file .*cut\.gguf"):
        Tokenizer.from_gguf(path)


def test_truncated_in_weights(tmp_path: Path) -> None:
    # An interrupted download: all metadata present, the tail of the weights missing. A tiny
    # file shows it as well as the real one, without copying 100 MB.
    path = tmp_path / "partial.gguf"
    _write_gguf(path, _tiny_bpe_keys())
    path.write_bytes(path.read_bytes()[:-16])
    with pytest.raises(ValueError, match=r"could not read GGUF file .*partial\.gguf"):
        Tokenizer.from_gguf(path)


def test_gguf_without_tokenizer_metadata(tmp_path: Path) -> None:
    path = tmp_path / "weights_only.gguf"
    _write_gguf(path, {})
    with pytest.raises(ValueError, match=r"weights_only\.gguf has no tokenizer metadata"):
        Tokenizer.from_gguf(path)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tokenizer.ggml.model": "llama"}, "'llama' \\(SentencePiece BPE\\)"),
        ({"tokenizer.ggml.model": "bert"}, "'bert' \\(WordPiece\\)"),
        ({"tokenizer.ggml.pre": "qwen2"}, "unsupported pre-tokenizer .*'qwen2'"),
        ({"tokenizer.ggml.merges": ["a q9"]}, "inconsistent vocabulary and merges"),
        ({"tokenizer.ggml.merges": ["abc"]}, "malformed merge 'abc'"),
    ],
)
def test_unsupported_tokenizers_are_named(tmp_path: Path, overrides: dict, message: str) -> None:
    path = tmp_path / "other.gguf"
    _write_gguf(path, _tiny_bpe_keys(**overrides))
    with pytest.raises(ValueError, match=f"other.gguf.*{message}"):
        Tokenizer.from_gguf(path)


def test_tiny_gguf_adds_bos_and_eos_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_gguf(
        path,
        _tiny_bpe_keys(
            **{"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}
        ),
    )
    tiny = Tokenizer.from_gguf(path)
    ab, space = tiny.token_to_id("ab"), tiny.token_to_id("Ġ")
    assert tiny.encode("ab ab") == [ab, space, ab]
    assert tiny.encode("ab ab", add_special_tokens=True) == [0, ab, space, ab, 1]
    assert tiny.decode([0, ab, 1], skip_special_tokens=True) == "ab"
    assert tiny.chat_template is None
    with pytest.raises(ValueError, match="has no chat template"):
        tiny.apply_chat_template([{"role": "user", "content": "x"}])
    assert read_gguf_vocab(path).fingerprint == tiny.fingerprint
