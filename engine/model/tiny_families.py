"""Tiny random-weight checkpoints of every served family, built by `transformers` itself.

For the family tests and `splitserve bench models`; `transformers` is a dev dependency, so
it is imported only when a model is built.

Each config is instantiated offline (2 layers, hidden 64), its weights redrawn at a scale
that makes logits peaked (greedy ties vanishingly rare), and saved as a safetensors folder:
the reference a user trusts, in the format a user has. Sliding windows are 12 tokens, so
prompts of a few dozen tokens run past them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

WINDOW = 12
VOCAB = 256
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


# Per family: the transformers config class and what it sets beyond _COMMON.
_FAMILY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama3": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
    ),
}


def _config(family: str, **overrides):
    import transformers as tf

    cls, extra = _FAMILY_CONFIGS[family]
    return getattr(tf, cls)(**{**_COMMON, **extra, **overrides})


FAMILIES = ("llama3", "qwen2", "qwen3", "mistral", "gemma3", "qwen3_moe", "qwen2_moe", "mixtral")


def reference_model(family: str, seed: int = 0, **overrides):
    """The transformers model (fp32, eager attention) with redrawn weights; `overrides` are
    config keys replacing the family's defaults."""
    import transformers as tf

    config = _config(family, **overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                # Gemma's norms store an offset from 1; the others the scale itself.
                base = 0.0 if family == "gemma3" else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / p.shape[-1] ** 0.5))
    return model.eval()


def save_family(family: str, folder: Path, seed: int = 0, **overrides):
    """Write the family's tiny checkpoint to `folder`; returns the reference model."""
    model = reference_model(family, seed, **overrides)
    model.save_pretrained(str(folder))
    return model


@torch.inference_mode()
def reference_logits(model, token_ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([token_ids])).logits[0].float()


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(reference_logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


# The tokenizer's first character: CJK ideographs, so that every token is one valid character.
_FIRST_CHAR = 0x4E00


def save_char_tokenizer(folder: Path) -> None:
    """A tokenizer.json for serving a tiny model end to end: token i is the one character
    chr(0x4E00 + i), so any id sequence is exactly a text and back (no byte-level pieces
    that decode to invalid UTF-8 on their own)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {chr(_FIRST_CHAR + i): i for i in range(VOCAB)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tok.decoder = decoders.Metaspace(prepend_scheme="never")
    tok.save(str(Path(folder) / "tokenizer.json"))
    # An end-of-text token, as every served tokenizer has (constrained decoding needs one):
    # the last id, which replies with `ignore_eos` run past.
    config = {"eos_token": chr(_FIRST_CHAR + VOCAB - 1)}
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config))


def char_token_ids(text: str) -> list[int]:
    """The ids save_char_tokenizer's tokenizer gives `text`."""
    return [ord(c) - _FIRST_CHAR for c in text]
