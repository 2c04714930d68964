"""Architecture hyper-parameters of a Llama-family decoder, from GGUF metadata or config.json."""

from __future__ import annotations

from dataclasses import dataclass


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

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden_size // self.num_heads

    @property
    def gqa_group(self) -> int:
        return self.num_heads // self.num_kv_heads
