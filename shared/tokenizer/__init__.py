"""Tokenizer, chat template and streaming detokenizer, all built from a GGUF's own metadata."""

from shared.tokenizer.detokenizer import IncrementalDetokenizer
from shared.tokenizer.gguf_vocab import GGUFVocab, TokenType, read_gguf_vocab
from shared.tokenizer.tokenizer import Tokenizer

__all__ = ["GGUFVocab", "IncrementalDetokenizer", "TokenType", "Tokenizer", "read_gguf_vocab"]
