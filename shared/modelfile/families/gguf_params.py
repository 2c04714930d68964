"""A GGUF's hyper-parameters as llama.cpp's converter writes them, read once for every family.

GGUF spells a hyper-parameter one way for every architecture (`<arch>.block_count`,
`<arch>.attention.head_count_kv`, ...). What differs per family is which keys its converter
writes and which conventions llama.cpp hard-codes instead of storing (Gemma 3's layer pattern,
Qwen 2 MoE's unnormalised routing); those are in the family modules. This module reads the
Llama-shaped part, the experts and the refusals every family shares. Features are also read
from which tensors the file holds (biases, per-layer experts), as llama.cpp itself does.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property
from math import prod
from typing import Any

from shared.modelfile.config import ModelConfig, ModelFileError, MoEConfig, RopeScaling
from shared.modelfile.gguf_header import GGUFHeader

# gguf.ExpertGatingFuncType.SOFTMAX: the only router activation the sparse MLP implements.
_SOFTMAX_GATING = 1


@dataclass(frozen=True)
class GGUFParams:
    """One file's metadata under its architecture's prefix, and its tensors' shapes."""

    header: GGUFHeader
    arch: str

    @property
    def path(self) -> str:
        return self.header.path

    def get(self, key: str, default: Any = None) -> Any:
        value = self.header.get(f"{self.arch}.{key}")
        return default if value is None else value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelFileError(self.path, f"GGUF metadata key '{self.arch}.{key}' is missing")
        return value

    @cached_property
    def _shapes(self) -> dict[str, tuple[int, ...]]:
        # PyTorch order: GGUF lists the contiguous dimension first.
        return {t.name: tuple(reversed(t.shape)) for t in self.header.tensors}

    def shape(self, tensor: str) -> tuple[int, ...] | None:
        return self._shapes.get(tensor)

    def has(self, tensor: str) -> bool:
        return self.shape(tensor) is not None

    def unsupported(self, feature: str) -> ModelFileError:
        """The error to raise for a feature the file asks for and no family implements."""
        return ModelFileError(self.path, f"unsupported config feature: {feature}")

    @property
    def num_layers(self) -> int:
        return int(self.require("block_count"))


def rope_scaling(p: GGUFParams, head_dim: int) -> RopeScaling | None:
    """Linear scaling is a factor in the metadata; Llama 3.1's blend comes as a `rope_freqs`
    tensor of per-pair divisors (read here: a few hundred bytes). YaRN, LongRoPE or a mix of
    two would be a silently different model if recomputed from the theta: refused by name."""
    kind = p.get("rope.scaling.type", "none")
    if p.has("rope_freqs.weight"):
        if kind != "none":
            raise p.unsupported(f"RoPE scaling ({kind}) on top of a rope_freqs tensor")
        factors = _rope_freqs(p)
        if len(factors) != head_dim // 2:
            raise ModelFileError(
                p.path, f"rope_freqs has {len(factors)} factors for {head_dim // 2} rotated pairs"
            )
        return RopeScaling("factors", freq_factors=factors)
    if kind == "none":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(p.require("rope.scaling.factor")))
    raise p.unsupported(f"RoPE scaling ({kind})")


def _rope_freqs(p: GGUFParams) -> tuple[float, ...]:
    (info,) = [t for t in p.header.tensors if t.name == "rope_freqs.weight"]
    if info.type_name != "F32":
        raise p.unsupported(f"a {info.type_name} rope_freqs tensor")
    count = prod(info.shape)
    # The header reader checked the tensor's bytes are all in the file.
    with open(p.path, "rb") as f:
        f.seek(info.offset)
        data = f.read(4 * count)
    return struct.unpack(f"{p.header.byte_order}{count}f", data)


def every_layer(p: GGUFParams, window: int | None) -> tuple[int | None, ...]:
    return (window,) * p.num_layers if window else ()


def refuse_sliding_window(p: GGUFParams) -> None:
    """Qwen's converters write no window (llama.cpp runs those layers globally); a file that
    has one does not say which layers slide (transformers' `max_window_layers`)."""
    if p.get("attention.sliding_window"):
        raise p.unsupported(
            f"a sliding window on a '{p.arch}' GGUF (which layers slide is not stored)"
        )


def moe_from_gguf(p: GGUFParams, normalise: bool) -> MoEConfig | None:
    """Routed experts, if the file has any; sparse layers are those holding a router
    (`blk.N.ffn_gate_inp`), as llama.cpp decides. `normalise` is the architecture's own
    rule, which an `expert_weights_norm` key overrides."""
    experts = int(p.get("expert_count", 0))
    if not experts:
        return None
    if int(p.get("expert_gating_func", _SOFTMAX_GATING)) != _SOFTMAX_GATING:
        raise p.unsupported("a router that is not a softmax")
    if float(p.get("expert_weights_scale", 1.0)) != 1.0:
        raise p.unsupported("scaled expert weights")
    if int(p.get("expert_shared_count", 1)) > 1:
        raise p.unsupported("more than one shared expert")
    sparse = tuple(p.has(f"blk.{i}.ffn_gate_inp.weight") for i in range(p.num_layers))
    first = sparse.index(True) if any(sparse) else 0
    size = p.get("expert_feed_forward_length")
    if size is None:  # Mixtral's converter writes the experts' width as the dense one
        merged = p.shape(f"blk.{first}.ffn_gate_exps.weight")
        size = merged[1] if merged else p.require("feed_forward_length")
    shared = p.get("expert_shared_feed_forward_length")
    if shared is None:
        shape = p.shape(f"blk.{first}.ffn_gate_shexp.weight")
        shared = shape[0] if shape else 0
    return MoEConfig(
        num_experts=experts,
        top_k=int(p.require("expert_used_count")),
        expert_intermediate_size=int(size),
        norm_topk_prob=bool(p.get("expert_weights_norm", normalise)),
        shared_intermediate_size=int(shared),
        sparse_layers=sparse,
    )


def vocab_size(p: GGUFParams) -> int:
    vocab = p.get("vocab_size")
    if vocab is None:
        tokens = p.header.get("tokenizer.ggml.tokens")
        embd = p.shape("token_embd.weight")
        vocab = len(tokens) if tokens is not None else embd[0] if embd else None
    if vocab is None:
        raise ModelFileError(p.path, "cannot tell the vocabulary size")
    return int(vocab)


def gguf_base_config(p: GGUFParams, architecture: str, **switches) -> ModelConfig:
    """The Llama-shaped part every family shares, plus the family's switches."""
    n_heads = int(p.require("attention.head_count"))
    hidden = int(p.require("embedding_length"))
    head_dim = p.get("attention.key_length")
    value_dim = p.get("attention.value_length", head_dim)
    if head_dim is not None and value_dim != head_dim:
        raise p.unsupported(f"value heads of {value_dim} != key heads of {head_dim}")
    rotated = p.get("rope.dimension_count")
    if rotated is not None and rotated != (head_dim or hidden // n_heads):
        raise p.unsupported("partial rotary embeddings")
    if "rope_theta" not in switches:
        switches = {
            "rope_theta": float(p.get("rope.freq_base", 10000.0)),
            "rope_scaling": rope_scaling(p, int(head_dim or hidden // n_heads)),
            **switches,
        }
    switches.setdefault("qkv_bias", p.has("blk.0.attn_q.bias"))
    try:
        return ModelConfig(
            vocab_size=vocab_size(p),
            hidden_size=hidden,
            intermediate_size=int(p.require("feed_forward_length")),
            num_layers=p.num_layers,
            num_heads=n_heads,
            num_kv_heads=int(p.get("attention.head_count_kv") or n_heads),
            rms_norm_eps=float(p.require("attention.layer_norm_rms_epsilon")),
            max_position=int(p.get("context_length", 2048)),
            tie_embeddings=not p.has("output.weight"),
            head_dim_override=int(head_dim) if head_dim is not None else None,
            architecture=architecture,
            **switches,
        )
    except ValueError as exc:
        raise ModelFileError(p.path, str(exc)) from exc
