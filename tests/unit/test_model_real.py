"""The real SmolLM2-135M-Instruct: our logits equal transformers' for the same GGUF, and the
engine's greedy output equals the plain single-sequence reference."""

from __future__ import annotations

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.kvcache.pool import KVPool
from kernels.attention_metadata import AttentionMetadata
from shared.sampling.params import SamplingParams
from tests.reference import greedy_reference

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived a",
    "日本の首都は東京です。 The weather today is 🌞 and",
    "Question: How do I boil an egg?\nAnswer:",
]


# SmolLM2-135M-Instruct as its model card's config.json gives it: the reference is built from
# these figures, not from what our GGUF reader makes of the file's metadata.
SMOLLM2_CONFIG = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
_HF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unrope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves each head's rotary halves in Q and K; transformers'
    rotate_half wants them back in two halves."""
    rows, cols = weight.shape
    return weight.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    """transformers' Llama over the GGUF's tensors, each dequantized by the `gguf` package.

    Not `from_pretrained(gguf_file=...)`: that reads the file's metadata twice through
    GGUFReader and maps every tensor name anew (30 s here, the slowest set-up in the unit
    tests); the dequantization, the rotary reordering and the forward are still not ours."""
    import gguf
    import numpy as np
    from transformers import LlamaConfig, LlamaForCausalLM

    from shared.modelfile.gguf_header import read_gguf_header

    header = read_gguf_header(gguf_path)
    data = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    config = LlamaConfig(**SMOLLM2_CONFIG, dtype=torch.float32)
    state: dict[str, torch.Tensor] = {}
    for t in header.tensors:
        qtype = gguf.GGMLQuantizationType[t.type_name]
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        rows = int(np.prod(t.shape[1:]))
        row_bytes = t.shape[0] // block * block_bytes
        raw = data[t.offset : t.offset + rows * row_bytes].reshape(rows, row_bytes)
        weight = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
        weight = weight.reshape(tuple(reversed(t.shape)))
        part, _, kind = t.name.rpartition(".")
        if part == "token_embd":
            state["model.embed_tokens.weight"] = weight
        elif part == "output_norm":
            state["model.norm.weight"] = weight
        else:
            _, layer, role = part.split(".")
            if role == "attn_q":
                weight = _unrope_rows(weight, config.num_attention_heads)
            elif role == "attn_k":
                weight = _unrope_rows(weight, config.num_key_value_heads)
            state[f"model.layers.{layer}.{_HF_NAMES[role]}.{kind}"] = weight
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def _our_logits(model, ids: list[int]) -> torch.Tensor:
    pool = KVPool(model.kv_layout(16), (len(ids) + 15) // 16)
    meta = AttentionMetadata([len(ids)], [len(ids)], [list(range(pool.num_blocks))], 16)
    return model.logits(model.forward(torch.tensor(ids), meta, pool))


@pytest.mark.real_model
@pytest.mark.parametrize("text", PROMPTS)
def test_logits_equal_transformers(real_model, real_tokenizer, hf_model, text):
    ids = real_tokenizer.encode(text)
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]
    ours = _our_logits(real_model, ids)
    assert (ours - expected).abs().max().item() <= 1e-3


@pytest.mark.real_model
def test_engine_greedy_equals_reference_alone_and_batched(real_model, real_tokenizer):
    chat = real_tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}])
    prompt = real_tokenizer.encode(chat)
    expected = greedy_reference(real_model, prompt, 12)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine = Engine(EngineConfig(num_blocks=64, max_num_batched_tokens=32), model=real_model)
    others = [real_tokenizer.encode(t) for t in PROMPTS[:3]]
    outputs = engine.generate([prompt, *others], params)
    assert outputs[0] == expected
    engine.blocks.check_integrity()


@pytest.mark.real_model
def test_int4_reuses_the_files_own_quantization(real_checkpoint):
    """Q4_1 blocks map exactly onto the int4 kernel: only bf16 rounding separates the two."""
    from engine.model.linear import Linear

    name = "layers.0.gate_proj"
    weight = real_checkpoint.tensors[name]
    int4 = Linear(weight, "int4", real_checkpoint.q4_1_blocks[name])
    x = torch.randn(3, weight.shape[1])
    reference = torch.nn.functional.linear(x.bfloat16().float(), weight)
    assert (int4(x) - reference).abs().max().item() < 0.05 * reference.abs().max().item()
