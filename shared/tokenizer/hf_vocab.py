"""The tokenizer of a Hugging Face folder: tokenizer.json (+ tokenizer_config.json).

Read into the same record a GGUF gives (the fields llama.cpp's converter would write from
these files), so identity, special tokens and decoding work the same for both; encoding
runs the folder's own `tokenizers` pipeline, loaded from tokenizer.json as it stands.
Byte-level BPE (Llama 3, Qwen, SmolLM2, Mistral's Tekken) and SentencePiece-style BPE with
"▁" spaces and byte fallback (Gemma, Llama 2, Mistral v0.1, Mixtral); anything else (Unigram,
WordPiece) is refused by name.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _RustTokenizer

from shared.tokenizer.gguf_vocab import GGUFVocab, TokenType


def _decoder_types(decoder: dict[str, Any] | None) -> list[str]:
    if not decoder:
        return []
    if decoder.get("type") == "Sequence":
        return [t for d in decoder.get("decoders", []) for t in _decoder_types(d)]
    return [decoder.get("type", "")]


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one serves chat
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default") or next(iter(named.values()), None)
    return template


def read_hf_vocab(folder: str | os.PathLike[str]) -> tuple[GGUFVocab, _RustTokenizer]:
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{folder}: no tokenizer.json in the model folder")
    try:
        spec = json.loads(path.read_text())
        rust = _RustTokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for files it cannot parse
        raise ValueError(f"{path}: unreadable tokenizer.json: {exc}") from exc
    model = spec.get("model") or {}
    decoders = _decoder_types(spec.get("decoder"))
    byte_level = "ByteLevel" in decoders
    pieces = bool({"Metaspace", "ByteFallback"} & set(decoders))
    if model.get("type") != "BPE" or not (byte_level or pieces):
        raise ValueError(
            f"{path}: unsupported tokenizer (model {model.get('type')!r}, decoder "
            f"{'/'.join(decoders) or 'none'}); byte-level or SentencePiece-style BPE only"
        )
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    ids: dict[str, int] = dict(model.get("vocab") or {})
    added = spec.get("added_tokens") or []
    for token in added:
        ids[token["content"]] = int(token["id"])
    size = max(ids.values()) + 1
    tokens: list[str | None] = [None] * size
    for token, i in ids.items():
        tokens[i] = token
    if None in tokens:
        raise ValueError(f"{path}: token id {tokens.index(None)} has no token")
    types = [int(TokenType.NORMAL)] * size
    for token in added:
        special = token.get("special", False)
        types[int(token["id"])] = int(TokenType.CONTROL if special else TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]

    def special_id(key: str) -> int | None:
        text = _token_text(config.get(key))
        return ids.get(text) if text is not None else None

    # BOS/EOS the folder's post-processor adds (what `add_special_tokens=True` means there).
    empty = rust.encode("", add_special_tokens=True).ids
    bos = special_id("bos_token")
    # The pre-tokenizer and normalizer decide the split: part of the identity, as the GGUF
    # `pre` name is.
    pipeline = json.dumps(
        [spec.get("normalizer"), spec.get("pre_tokenizer")], sort_keys=True
    ).encode()
    vocab = GGUFVocab(
        path=str(folder),
        # llama.cpp's names: "gpt2" byte-level BPE, "llama" SentencePiece-style BPE.
        model="gpt2" if byte_level else "llama",
        pre="hf:" + hashlib.sha256(pipeline).hexdigest()[:16],
        tokens=tuple(tokens),  # type: ignore[arg-type]
        token_types=tuple(types),
        merges=tuple(merges),
        bos_token_id=bos,
        eos_token_id=special_id("eos_token"),
        unknown_token_id=special_id("unk_token"),
        padding_token_id=special_id("pad_token"),
        add_bos_token=bos is not None and empty[:1] == [bos],
        add_eos_token=False,
        chat_template=_chat_template(folder, config),
        add_space_prefix=not byte_level and _prefixes_space(spec),
    )
    return vocab, rust


def _prefixes_space(spec: dict[str, Any]) -> bool:
    """Whether the encoder puts a "▁" before the text (a Metaspace pre-tokenizer that
    prepends, or Llama 2's Prepend normalizer): the decoder strips it again."""
    text = json.dumps([spec.get("pre_tokenizer"), spec.get("normalizer")])
    metaspace = '"Metaspace"' in text and '"prepend_scheme": "never"' not in text
    return metaspace or '"Prepend"' in text
