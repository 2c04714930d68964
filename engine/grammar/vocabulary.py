"""Our tokenizer as the grammar engine sees it: every token's raw bytes, which ids are
special (never spelled by a grammar), and which end the output."""

from __future__ import annotations

import llguidance

from shared.tokenizer.tokenizer import Tokenizer


class _TokenizerView:
    """The duck-typed tokenizer `llguidance.TokenizerWrapper` reads."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(tokenizer.special_token_ids)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text)


def grammar_vocabulary(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """Build once per engine (~0.1 s for a 49k vocabulary). Every stop token of the model
    ends a grammar's output, so a finished grammar lets exactly those through."""
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_TokenizerView(tokenizer)),
        n_vocab=tokenizer.vocab_size,
        eos_token=sorted(tokenizer.stop_token_ids),
    )
