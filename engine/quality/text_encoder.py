"""Text -> token ids for the model under evaluation, from the model's own files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from shared.modelfile.config import ModelFileError
from shared.tokenizer import Tokenizer


class TextEncoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


class _HFTokenizerJson:
    """A Hugging Face folder's tokenizer.json, encoding without added BOS/EOS (as the GGUF
    tokenizer does), so scoring sees the same ids whichever format the model came in."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as RustTokenizer

        self._rust = RustTokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._rust.encode(text, add_special_tokens=False).ids


def load_text_encoder(model_path: str | os.PathLike) -> TextEncoder:
    path = Path(model_path)
    if path.is_dir():
        tokenizer_json = path / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise ModelFileError(str(path), "no tokenizer.json in the model folder")
        return _HFTokenizerJson(tokenizer_json)
    return Tokenizer.from_gguf(path)
