"""One decoder layer's weights in a torch format, built from a checkpoint for any family.

Q/K/V and gate/up are fused into one matmul each (fewer, larger kernel calls). The optional
parts are what the config's switches ask for: Q/K/V biases, per-head q/k norms, Gemma's
output norms, a sparse MLP in place of the dense one.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from engine.model.gguf_file import Checkpoint
from engine.model.linear import Linear, WeightFormat, fuse_q4_1, fuse_rows
from engine.model.moe import ExpertsKernel, SparseMLP
from engine.model.native_step import NativeMatrix
from engine.model.tensor_names import is_sparse
from shared.modelfile.config import ModelConfig

Matrix = Linear | NativeMatrix  # y = x @ W.T, whichever kernel computes it

_HEAD_FORMAT: dict[str, WeightFormat] = {"int4": "bf16"}


@dataclass
class DecoderLayer:
    input_norm: torch.Tensor
    qkv: Matrix
    o_proj: Matrix
    post_attention_norm: torch.Tensor  # the norm before the MLP
    gate_up: Matrix | None  # None where the layer's MLP is sparse
    down: Matrix | None
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    sparse: SparseMLP | None = None

    def dense_matrices(self) -> list[Matrix]:
        return [m for m in (self.qkv, self.o_proj, self.gate_up, self.down) if m is not None]

    def all_matrices(self) -> list[Matrix]:
        matrices = self.dense_matrices()
        if self.sparse is not None:
            for gate_up, down in self.sparse.experts:
                matrices += [gate_up, down]
            if self.sparse.shared is not None:
                matrices += list(self.sparse.shared[:2])
        return matrices


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Spelled out: torch's CPU F.rms_norm was measured slower here (22 vs ~10 us per call).
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def norm_weight(t: dict[str, torch.Tensor], name: str, cfg: ModelConfig, dev) -> torch.Tensor:
    """A norm's scale as the forward multiplies it: Gemma's stored offset from 1 folded in."""
    return (t[name] + cfg.norm_offset).to(dev)


def _sparse_mlp(
    checkpoint: Checkpoint, layer: int, weights: WeightFormat, dev: torch.device
) -> SparseMLP:
    cfg = checkpoint.config
    moe = cfg.moe
    assert moe is not None
    t = checkpoint.tensors
    p = f"layers.{layer}."

    def pair(prefix: str) -> tuple[Linear, Linear]:
        gate_up = fuse_rows([t[prefix + "gate_proj"], t[prefix + "up_proj"]]).to(dev)
        return Linear(gate_up, weights), Linear(t[prefix + "down_proj"].to(dev), weights)

    experts = [pair(f"{p}experts.{e}.") for e in range(moe.num_experts)]
    shared = None
    shared_gate = None
    if moe.shared_intermediate_size:
        shared = (*pair(p + "shared."), moe.shared_intermediate_size)
        shared_gate = t[p + "shared_gate"].to(dev)
    # Triton's fused experts on a GPU (fp32 weights); each expert's Linears elsewhere.
    kernel: ExpertsKernel = "triton" if dev.type == "cuda" and weights == "fp32" else "torch"
    if kernel == "triton" and importlib.util.find_spec("triton") is None:
        kernel = "torch"
    return SparseMLP(
        t[p + "expert_gate"].to(dev),
        experts,
        moe.expert_intermediate_size,
        moe.top_k,
        moe.norm_topk_prob,
        cfg.activation,
        shared,
        shared_gate,
        kernel,
    )


def torch_layers(
    checkpoint: Checkpoint, weights: WeightFormat, dev: torch.device, head: bool = True
) -> tuple[list[DecoderLayer], Linear | None]:
    cfg = checkpoint.config
    t = checkpoint.tensors
    blocks = checkpoint.q4_1_blocks
    # The output projection decides the argmax: 4-bit groups there flipped 14.5% of fp32's
    # top-1 tokens (quality gate, PIQA set), so int4 builds keep it in bf16.
    lm_head = (
        Linear(
            t.get("lm_head", t["embed_tokens"]).to(dev),
            _HEAD_FORMAT.get(weights, weights),
            blocks.get("lm_head"),
        )
        if head
        else None
    )
    layers: list[DecoderLayer] = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        qkv_names = [p + "q_proj", p + "k_proj", p + "v_proj"]
        gate_up_names = [p + "gate_proj", p + "up_proj"]
        sparse = is_sparse(cfg, i)
        optional = {
            "q_norm": norm_weight(t, p + "q_norm", cfg, dev) if cfg.qk_norm else None,
            "k_norm": norm_weight(t, p + "k_norm", cfg, dev) if cfg.qk_norm else None,
            "attn_out_norm": norm_weight(t, p + "attn_out_norm", cfg, dev)
            if cfg.sandwich_norms
            else None,
            "mlp_out_norm": norm_weight(t, p + "mlp_out_norm", cfg, dev)
            if cfg.sandwich_norms
            else None,
        }
        layers.append(
            DecoderLayer(
                input_norm=norm_weight(t, p + "input_norm", cfg, dev),
                qkv=Linear(
                    fuse_rows([t[n] for n in qkv_names]).to(dev),
                    weights,
                    fuse_q4_1([blocks.get(n) for n in qkv_names]),
                ),
                o_proj=Linear(t[p + "o_proj"].to(dev), weights, blocks.get(p + "o_proj")),
                post_attention_norm=norm_weight(t, p + "post_attention_norm", cfg, dev),
                gate_up=None
                if sparse
                else Linear(
                    fuse_rows([t[n] for n in gate_up_names]).to(dev),
                    weights,
                    fuse_q4_1([blocks.get(n) for n in gate_up_names]),
                ),
                down=None
                if sparse
                else Linear(t[p + "down_proj"].to(dev), weights, blocks.get(p + "down_proj")),
                qkv_bias=torch.cat([t[p + "q_bias"], t[p + "k_bias"], t[p + "v_bias"]]).to(dev)
                if cfg.qkv_bias
                else None,
                sparse=_sparse_mlp(checkpoint, i, weights, dev) if sparse else None,
                **optional,
            )
        )
    return layers, lm_head
