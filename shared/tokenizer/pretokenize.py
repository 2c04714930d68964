"""Pre-tokenizers: how text is cut into chunks before BPE merges run inside each chunk.

A merge list is only right for the split it was learned on, so the split is chosen from the
file's `tokenizer.ggml.pre` name, the same names llama.cpp uses. Names we do not know are
refused: guessing would produce ids the model was never trained on, silently.
"""

from __future__ import annotations

from tokenizers import pre_tokenizers

# The GPT-2 split (contractions, letter runs, number runs, punctuation runs, whitespace), which
# `ByteLevel(use_regex=True)` applies before mapping bytes to the byte alphabet.
_GPT2_STYLE = frozenset({"gpt2", "mpt", "olmo", "jais"})

# The GPT-2 split, after first isolating every single digit (StarCoder's scheme, which SmolLM
# inherited). This differs from plain GPT-2 only before digits: "x  1" is x|ĠĠ|1 here, and
# x|Ġ|Ġ1 -> x,Ġ,Ġ,1 under plain GPT-2, since no vocabulary entry joins a space to a digit.
_DIGITS_THEN_GPT2 = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
)

SUPPORTED_PRE_TOKENIZERS = tuple(sorted(_GPT2_STYLE | _DIGITS_THEN_GPT2))


def splits_digits_first(pre: str | None) -> bool | None:
    """Whether the GPT-2 split of `pre` isolates each digit first; None where `pre` is not a
    GPT-2-style split at all (shared/tokenizer/word_cache.py takes only these)."""
    if pre in _DIGITS_THEN_GPT2:
        return True
    if pre in _GPT2_STYLE:
        return False
    return None


def build_pre_tokenizer(pre: str | None, source: str) -> pre_tokenizers.PreTokenizer:
    """The `tokenizers` pre-tokenizer for a GGUF `tokenizer.ggml.pre` value.

    `source` names the file in the error message.
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_STYLE:
        return byte_level
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    raise ValueError(
        f"{source}: unsupported pre-tokenizer tokenizer.ggml.pre={pre!r}; "
        f"supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}"
    )
