"""A tiny random-weight Llama: fast enough for unit tests of everything above the model.

Not a fake: it runs the very same code path as the real model, with small random weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from engine.model.gguf_file import Checkpoint
from engine.model.tensor_names import expected_tensor_names
from shared.modelfile.config import ModelConfig

TINY_CONFIG = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position=1024,
    tie_embeddings=True,
)


def tiny_checkpoint(seed: int = 0, config: ModelConfig = TINY_CONFIG) -> Checkpoint:
    gen = torch.Generator().manual_seed(seed)
    c = config
    d = c.head_dim
    shapes = {
        "embed_tokens": (c.vocab_size, c.hidden_size),
        "norm": (c.hidden_size,),
        "lm_head": (c.vocab_size, c.hidden_size),
        "input_norm": (c.hidden_size,),
        "post_attention_norm": (c.hidden_size,),
        "q_proj": (c.num_heads * d, c.hidden_size),
        "k_proj": (c.num_kv_heads * d, c.hidden_size),
        "v_proj": (c.num_kv_heads * d, c.hidden_size),
        "o_proj": (c.hidden_size, c.num_heads * d),
        "gate_proj": (c.intermediate_size, c.hidden_size),
        "up_proj": (c.intermediate_size, c.hidden_size),
        "down_proj": (c.hidden_size, c.intermediate_size),
    }
    tensors = {}
    for name in expected_tensor_names(c):
        shape = shapes[name.rsplit(".", 1)[-1]]
        if len(shape) == 1:
            tensors[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            # Larger-than-usual scale so logits are peaked: greedy ties are then vanishingly rare.
            tensors[name] = torch.randn(shape, generator=gen) * (1.5 / shape[1] ** 0.5)
    return Checkpoint(config=c, tensors=tensors, source=f"tiny-random-seed{seed}")


def write_hf_folder(checkpoint: Checkpoint, folder: str | Path) -> Path:
    """Save as a Hugging Face folder (config.json + model.safetensors) that our loader reads."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = checkpoint.config
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": c.vocab_size,
                "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size,
                "num_hidden_layers": c.num_layers,
                "num_attention_heads": c.num_heads,
                "num_key_value_heads": c.num_kv_heads,
                "rope_theta": c.rope_theta,
                "rms_norm_eps": c.rms_norm_eps,
                "max_position_embeddings": c.max_position,
                "tie_word_embeddings": c.tie_embeddings,
            }
        )
    )
    hf_names = {
        "input_norm": "input_layernorm.weight",
        "q_proj": "self_attn.q_proj.weight",
        "k_proj": "self_attn.k_proj.weight",
        "v_proj": "self_attn.v_proj.weight",
        "o_proj": "self_attn.o_proj.weight",
        "post_attention_norm": "post_attention_layernorm.weight",
        "gate_proj": "mlp.gate_proj.weight",
        "up_proj": "mlp.up_proj.weight",
        "down_proj": "mlp.down_proj.weight",
    }
    state = {}
    for name, value in checkpoint.tensors.items():
        if name == "embed_tokens":
            state["model.embed_tokens.weight"] = value
        elif name == "norm":
            state["model.norm.weight"] = value
        elif name == "lm_head":
            state["lm_head.weight"] = value
        else:
            _, layer, short = name.split(".")
            state[f"model.layers.{layer}.{hf_names[short]}"] = value
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


def _q4_1(w: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """GGUF Q4_1 blocks of w [out, in] and their exact dequantization."""
    out, n = w.shape
    x = w.reshape(out, n // 32, 32).double()
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    d = ((hi - lo) / 15).to(torch.float16)
    m = lo.to(torch.float16)
    safe = torch.where(d.double() > 0, d.double(), 1.0)
    q = ((x - m.double()) / safe).round().clamp(0, 15).to(torch.uint8)
    blocks = np.zeros((out, n // 32, 20), dtype=np.uint8)
    blocks[..., 0:2] = d.numpy().view(np.uint8).reshape(out, n // 32, 2)
    blocks[..., 2:4] = m.numpy().view(np.uint8).reshape(out, n // 32, 2)
    qn = q.numpy()
    blocks[..., 4:] = qn[..., :16] | (qn[..., 16:] << 4)
    dense = q.float() * d.float() + m.float()
    return blocks, dense.reshape(out, n)


def _q8_0(w: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """GGUF Q8_0 blocks of w [out, in] and their exact dequantization."""
    out, n = w.shape
    x = w.reshape(out, n // 32, 32).double()
    d = (x.abs().amax(-1, keepdim=True) / 127).to(torch.float16)
    safe = torch.where(d.double() > 0, d.double(), 1.0)
    q = (x / safe).round().clamp(-127, 127).to(torch.int8)
    blocks = np.zeros((out, n // 32, 34), dtype=np.uint8)
    blocks[..., 0:2] = d.numpy().view(np.uint8).reshape(out, n // 32, 2)
    blocks[..., 2:] = q.numpy().view(np.uint8)
    return blocks, (q.float() * d.float()).reshape(out, n)


def tiny_quantized_checkpoint(seed: int = 0, config: ModelConfig = TINY_CONFIG) -> Checkpoint:
    """The tiny model as a GGUF of the bundled model's kinds would hold it: layer matrices in
    Q4_1 blocks, embedding/head in Q8_0, each fp32 tensor the exact dequantization of its
    blocks (what the native step's quantized kernels are tested on)."""
    ck = tiny_checkpoint(seed, config)
    tensors = dict(ck.tensors)
    q4_1: dict[str, np.ndarray] = {}
    q8_0: dict[str, np.ndarray] = {}
    for name, w in ck.tensors.items():
        if w.dim() != 2:
            continue
        if name in ("embed_tokens", "lm_head"):
            q8_0[name], tensors[name] = _q8_0(w)
        else:
            q4_1[name], tensors[name] = _q4_1(w)
    return Checkpoint(
        config=ck.config,
        tensors=tensors,
        source=f"tiny-quantized-seed{seed}",
        q4_1_blocks=q4_1,
        q8_0_blocks=q8_0,
    )
