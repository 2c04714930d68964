"""The real SmolLM2-135M-Instruct: our logits equal transformers' for the same GGUF, and the
engine's greedy output equals the plain single-sequence reference."""

from __future__ import annotations

import os

import pytest
import torch

from kernels.attention_metadata import AttentionMetadata
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.kvcache.pool import KVPool
from shared.sampling.params import SamplingParams
from tests.reference import greedy_reference

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived a",
    "日本の首都は東京です。 The weather today is 🌞 and",
    "Question: How do I boil an egg?\nAnswer:",
]


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    )
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
    from shared.model.linear import Linear

    name = "layers.0.gate_proj"
    weight = real_checkpoint.tensors[name]
    int4 = Linear(weight, "int4", real_checkpoint.q4_1_blocks[name])
    x = torch.randn(3, weight.shape[1])
    reference = torch.nn.functional.linear(x.bfloat16().float(), weight)
    assert (int4(x) - reference).abs().max().item() < 0.05 * reference.abs().max().item()
