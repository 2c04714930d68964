"""Architecture hyper-parameters of a decoder, from GGUF metadata or config.json.

One shape for every registered family (shared/modelfile/families/): a family is Llama's layout
plus a few switches (QKV bias, per-head q/k norms, sliding windows, Gemma's norms, experts).
Plain data, no torch: the coordinator reads it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Activation = Literal["silu", "gelu_tanh"]


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency rescaling: `linear` (positions / factor), `llama3` (Llama 3.1's
    wavelength-dependent blend), or `factors`: one divisor per rotated pair, as a GGUF's
    `rope_freqs` tensor stores Llama 3.1's blend. Anything else is refused where the config
    is read."""

    kind: Literal["linear", "llama3", "factors"]
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    freq_factors: tuple[float, ...] = ()


@dataclass(frozen=True)
class MoEConfig:
    """A sparse MLP: `top_k` of `num_experts` gated experts per token, plus an optional
    shared expert (Qwen2-MoE) whose output is scaled by a sigmoid gate."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    # Renormalise the top-k router probabilities to sum to 1 (Mixtral always; Qwen per config).
    norm_topk_prob: bool
    shared_intermediate_size: int = 0
    # Per layer: True where the layer is sparse (Qwen's decoder_sparse_step / mlp_only_layers).
    sparse_layers: tuple[bool, ...] = ()


class ModelFileError(ValueError):
    """A model file is missing, truncated, or describes something we cannot run."""

    def __init__(self, path: str, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_embeddings: bool = True
    head_dim_override: int | None = None
    # The registered family (shared/modelfile/families/) whose layout this is.
    architecture: str = "llama"
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen 3, Gemma 3)
    # Gemma stores RMSNorm weights as offsets from 1: the scale is (norm_offset + w).
    norm_offset: float = 0.0
    activation: Activation = "silu"
    embed_scale: float = 1.0
    # Attention scale is query_scale ** -0.5 (Gemma's query_pre_attn_scalar); None: head_dim.
    query_scale: float | None = None
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    # Per layer: the sliding window in tokens (a query sees the `window` most recent keys,
    # itself included), or None for global attention. Empty: every layer global.
    layer_windows: tuple[int | None, ...] = ()
    # RoPE theta of the sliding layers when it differs from the global ones (Gemma 3).
    local_rope_theta: float | None = None
    # Gemma's extra norms on the attention and MLP outputs before each residual add.
    sandwich_norms: bool = False
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        if self.head_dim_override is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(
                f"{len(self.layer_windows)} layer windows for {self.num_layers} layers"
            )

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def max_window(self) -> int | None:
        """The widest window when every layer slides, else None (some layer sees everything):
        only then can KV older than the window be dropped."""
        if not self.layer_windows or any(w is None for w in self.layer_windows):
            return None
        return max(w for w in self.layer_windows if w is not None)

    @property
    def is_plain_llama(self) -> bool:
        """Llama's exact layout: what the native step and the quality gate's dense forward
        were written for."""
        return (
            self.architecture == "llama"
            and self.rope_scaling is None
            and not (self.qkv_bias or self.qk_norm or self.sandwich_norms)
            and self.norm_offset == 0.0
            and self.activation == "silu"
            and self.embed_scale == 1.0
            and self.query_scale is None
            and self.final_softcap is None
            and not any(w is not None for w in self.layer_windows)
            and self.moe is None
        )

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden_size // self.num_heads

    @property
    def gqa_group(self) -> int:
        return self.num_heads // self.num_kv_heads
