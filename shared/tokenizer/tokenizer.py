"""Text <-> token ids for a model, built from the model's own files: a GGUF's metadata, or a
Hugging Face folder's tokenizer.json."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, models
from tokenizers import Tokenizer as _RustTokenizer

from shared.tokenizer.byte_level import token_bytes_table
from shared.tokenizer.chat_template import ChatTemplate
from shared.tokenizer.gguf_vocab import GGUFVocab, read_gguf_vocab
from shared.tokenizer.hf_vocab import read_hf_vocab
from shared.tokenizer.pretokenize import build_pre_tokenizer, splits_digits_first
from shared.tokenizer.spm_pieces import spm_token_bytes_table
from shared.tokenizer.word_cache import WordCache

# What each `tokenizer.ggml.model` value means, for an error message a person can act on.
_TOKENIZER_MODELS = {
    "gpt2": "byte-level BPE",
    "llama": "SentencePiece BPE",
    "t5": "SentencePiece Unigram",
    "bert": "WordPiece",
    "rwkv": "RWKV greedy",
    "plamo2": "PLaMo-2 Aho-Corasick",
    "no_vocab": "no vocabulary",
    "none": "no vocabulary",
}

# Turn-ending tokens a chat model may emit instead of its declared EOS. Generation must stop at
# any of them, or the model starts writing the next turn of the conversation itself.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


class Tokenizer:
    """A byte-level BPE tokenizer exactly as the GGUF file describes it."""

    def __init__(self, vocab: GGUFVocab, rust: _RustTokenizer | None = None) -> None:
        # A folder's SentencePiece-style BPE encodes through its own tokenizer.json; a GGUF's
        # would need its pipeline rebuilt from metadata, which only byte-level BPE has here.
        spm = vocab.model == "llama" and rust is not None
        if vocab.model != "gpt2" and not spm:
            kind = _TOKENIZER_MODELS.get(vocab.model, "unknown")
            raise ValueError(
                f"{vocab.path}: unsupported tokenizer model tokenizer.ggml.model="
                f"{vocab.model!r} ({kind}); only 'gpt2' (byte-level BPE) is supported"
            )
        self._vocab = vocab
        # A folder brings its own pipeline (tokenizer.json); a GGUF's is rebuilt from metadata.
        self._rust = rust if rust is not None else _build_rust_tokenizer(vocab)
        self._word_cache = None if rust is not None else _word_cache(vocab, self._rust)
        verbatim = {*vocab.control_token_ids, *vocab.user_defined_token_ids}
        self._token_bytes = (
            spm_token_bytes_table(vocab.tokens, verbatim)
            if spm
            else token_bytes_table(vocab.tokens)
        )
        self._special_ids = frozenset(vocab.control_token_ids)
        stops = {vocab.eos_token_id} if vocab.eos_token_id is not None else set()
        stops |= {i for i in self._special_ids if vocab.tokens[i] in END_OF_TURN_TOKENS}
        self._stop_ids = frozenset(stops)
        add_bos = vocab.add_bos_token and vocab.bos_token_id is not None
        add_eos = vocab.add_eos_token and vocab.eos_token_id is not None
        self._prefix_ids = (vocab.bos_token_id,) if add_bos else ()
        self._suffix_ids = (vocab.eos_token_id,) if add_eos else ()
        self._chat_template = None
        if vocab.chat_template:
            self._chat_template = ChatTemplate(
                vocab.chat_template,
                bos_token=self._token_text(vocab.bos_token_id),
                eos_token=self._token_text(vocab.eos_token_id),
                origin=vocab.path,
            )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        return cls(read_gguf_vocab(path))

    @classmethod
    def from_hf_folder(cls, folder: str | os.PathLike[str]) -> Tokenizer:
        return cls(*read_hf_vocab(folder))

    @classmethod
    def from_model_path(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """The tokenizer shipped with a model: a folder's tokenizer.json, or a GGUF's own."""
        return cls.from_hf_folder(path) if os.path.isdir(path) else cls.from_gguf(path)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(path={self._vocab.path!r}, vocab_size={self.vocab_size}, "
            f"pre={self._vocab.pre!r}, fingerprint={self.fingerprint[:12]}...)"
        )

    # -- identity and special tokens -------------------------------------------------------

    @property
    def vocab(self) -> GGUFVocab:
        return self._vocab

    @property
    def vocab_size(self) -> int:
        return self._vocab.vocab_size

    @property
    def fingerprint(self) -> str:
        """sha256 hex of vocab, merges, token types, pre-tokenizer and special ids."""
        return self._vocab.fingerprint

    @property
    def bos_token_id(self) -> int | None:
        return self._vocab.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._vocab.eos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self._vocab.padding_token_id

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """EOS plus the end-of-turn control tokens present (here <|im_end|>, <|endoftext|>)."""
        return self._stop_ids

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Control tokens: matched whole in text, dropped by `skip_special_tokens`."""
        return self._special_ids

    @property
    def chat_template(self) -> str | None:
        return self._vocab.chat_template

    def id_to_token(self, token_id: int) -> str:
        self._check_ids((token_id,))
        return self._vocab.tokens[token_id]

    def token_to_id(self, token: str) -> int | None:
        return self._rust.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for; may be part of a multi-byte UTF-8 character."""
        self._check_ids((token_id,))
        return self._token_bytes[token_id]

    # -- encoding and decoding -------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids for `text`. Control tokens written in the text (e.g. "<|im_start|>") are
        always matched as single tokens; `add_special_tokens` only adds BOS/EOS where the
        file asks for them (this model asks for neither)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        ids = self._word_cache.encode(text) if self._word_cache is not None else None
        if ids is None:
            ids = self._rust.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            ids = [*self._prefix_ids, *ids, *self._suffix_ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text for `ids`. Bytes that do not form valid UTF-8 become U+FFFD."""
        ids = list(ids)
        self._check_ids(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        table = self._token_bytes
        text = b"".join(table[i] for i in ids).decode("utf-8", errors="replace")
        if self._vocab.add_space_prefix and text.startswith(" "):
            text = text[1:]  # the space the encoder put in front
        return text

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text for a conversation, rendered with the file's own chat template.

        Message `content` may be a string or a list of `{"type": "text", "text": ...}` parts.
        `tools` only if `chat_template_supports_tools`.
        """
        if self._chat_template is None:
            raise ValueError(f"{self._vocab.path} has no chat template")
        return self._chat_template.render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools
        )

    @property
    def chat_template_supports_tools(self) -> bool:
        """Whether the file's chat template renders tool definitions itself."""
        return self._chat_template is not None and self._chat_template.supports_tools

    # -- helpers ---------------------------------------------------------------------------

    def _check_ids(self, ids: Sequence[int]) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self._vocab.tokens[token_id]


def _word_cache(vocab: GGUFVocab, rust: _RustTokenizer) -> WordCache | None:
    """The plain-ASCII fast path where the file's split is one it reproduces exactly."""
    digits_first = splits_digits_first(vocab.pre)
    if vocab.model != "gpt2" or digits_first is None:
        return None
    bpe = rust.model

    def tokenize_word(word: str) -> list[int]:
        return [t.id for t in bpe.tokenize(word)]

    added = {vocab.tokens[i]: i for i in (*vocab.control_token_ids, *vocab.user_defined_token_ids)}
    return WordCache(tokenize_word, digits_first, added)


def _build_rust_tokenizer(vocab: GGUFVocab) -> _RustTokenizer:
    """The HF `tokenizers` pipeline for the file: byte-level BPE over the file's own split."""
    merges = []
    for merge in vocab.merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(f"{vocab.path}: malformed merge {merge!r} (expected 'left right')")
        merges.append((parts[0], parts[1]))
    # Duplicate spellings keep the last id, as llama.cpp's own lookup does.
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    try:
        bpe = models.BPE(vocab=ids, merges=merges, fuse_unk=False)
    except Exception as e:  # tokenizers raises a bare Exception for merges it cannot resolve
        raise ValueError(f"{vocab.path}: inconsistent vocabulary and merges: {e}") from e
    # Only encoding goes through `tokenizers`; decoding is a byte-table join (see decode()).
    rust = _RustTokenizer(bpe)
    rust.pre_tokenizer = build_pre_tokenizer(vocab.pre, vocab.path)

    def added(token_ids: Sequence[int], special: bool) -> list[AddedToken]:
        return [AddedToken(vocab.tokens[i], special=special, normalized=False) for i in token_ids]

    rust.add_special_tokens(added(vocab.control_token_ids, special=True))
    rust.add_tokens(added(vocab.user_defined_token_ids, special=False))
    for i in (*vocab.control_token_ids, *vocab.user_defined_token_ids):
        if rust.token_to_id(vocab.tokens[i]) != i:
            raise ValueError(
                f"{vocab.path}: added token {vocab.tokens[i]!r} resolves to "
                f"{rust.token_to_id(vocab.tokens[i])}, not its own id {i}"
            )

    return rust
