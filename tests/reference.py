"""The plain single-sequence reference every engine path must match: dense attention over the
whole sequence, recomputed from scratch for every token — no paging, no cache, no batching."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.layers import rms_norm
from engine.model.llama import LlamaModel
from engine.model.rope import RotaryEmbedding


@torch.inference_mode()
def dense_logits(model: LlamaModel, token_ids: list[int]) -> torch.Tensor:
    cfg = model.config
    n = len(token_ids)
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    cos, sin = model.rope.tables(torch.arange(n))
    x = model.embed_tokens[torch.tensor(token_ids)]
    for layer in model.layers:
        h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
        qkv = layer.qkv(h)
        q = RotaryEmbedding.apply(qkv[:, : hq * d].view(n, hq, d), cos, sin)
        k = RotaryEmbedding.apply(qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d), cos, sin)
        v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
        k = k.repeat_interleave(cfg.gqa_group, dim=1)
        v = v.repeat_interleave(cfg.gqa_group, dim=1)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        x = x + layer.o_proj(attn.transpose(0, 1).reshape(n, hq * d))
        h = rms_norm(x, layer.post_attention_norm, cfg.rms_norm_eps)
        gu = layer.gate_up(h)
        x = x + layer.down(F.silu(gu[:, : cfg.intermediate_size]) * gu[:, cfg.intermediate_size :])
    return model.logits(rms_norm(x, model.norm, cfg.rms_norm_eps))


def greedy_reference(model: LlamaModel, prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        nxt = int(dense_logits(model, tokens)[-1].argmax())
        out.append(nxt)
        tokens.append(nxt)
    return out
