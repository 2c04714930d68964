"""What a profile needs to know about a model: its shape, not its weights.

A measured profile reads it from the checkpoint it loaded; an analytic one from a config
alone (a Hugging Face `config.json`, or a GGUF's header), so a 70B model can be planned for
without its weights. Mixture-of-experts layers are described by how many experts a layer has,
how many each token runs, and their width; a shared expert (Qwen2-MoE style) runs for every
token. The hash over these fields is the "same model" test a profile's signature carries.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from shared.modelfile.config import ModelConfig, ModelFileError


@dataclass(frozen=True)
class ModelShape:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # a dense layer's MLP width
    max_position: int
    tie_embeddings: bool
    num_experts: int = 0  # 0: every layer is dense
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # runs for every token, beside the routed ones
    moe_layers: int = 0  # how many of num_layers are MoE (the rest dense)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: {self.num_heads} heads are not a multiple of "
                f"{self.num_kv_heads} KV heads"
            )
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"{self.name}: experts_per_token must be in 1..num_experts")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and self.moe_layers > 0

    @property
    def dense_layers(self) -> int:
        return self.num_layers - self.moe_layers

    @property
    def config_hash(self) -> str:
        """Of the shape alone: the same architecture under another name hashes the same."""
        fields = asdict(self)
        del fields["name"]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def from_config(cls, config: ModelConfig, name: str) -> ModelShape:
        """Of a loaded config, any family: the same shape `from_hf_config` reads from its
        config.json, so a measured profile and an analytic one of a model hash the same."""
        moe = config.moe
        experts = {}
        if moe is not None:
            experts = dict(
                num_experts=moe.num_experts,
                experts_per_token=moe.top_k,
                expert_intermediate_size=moe.expert_intermediate_size,
                shared_expert_intermediate_size=moe.shared_intermediate_size,
                moe_layers=sum(moe.sparse_layers),
            )
        return cls(
            name=name,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            num_layers=config.num_layers,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            intermediate_size=config.intermediate_size,
            max_position=config.max_position,
            tie_embeddings=config.tie_embeddings,
            **experts,
        )

    @classmethod
    def from_hf_config(cls, raw: dict, name: str) -> ModelShape:
        """Llama/Mistral/Qwen dense configs; Mixtral, Qwen2-MoE and Qwen3-MoE expert fields."""
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        layers = int(raw["num_hidden_layers"])
        experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
        moe_layers = 0
        expert_width = 0
        if experts:
            # Mixtral's experts are `intermediate_size` wide; Qwen's MoE have their own width.
            expert_width = int(raw.get("moe_intermediate_size") or raw["intermediate_size"])
            step = int(raw.get("decoder_sparse_step") or 1)
            dense_only = set(raw.get("mlp_only_layers") or [])
            moe_layers = sum(
                1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0
            )
        return cls(
            name=name,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(raw.get("intermediate_size") or 0),
            max_position=int(raw.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            num_experts=experts,
            experts_per_token=int(raw.get("num_experts_per_tok") or 0) if experts else 0,
            expert_intermediate_size=expert_width,
            shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
            moe_layers=moe_layers,
        )


def read_model_shape(path: str | Path) -> ModelShape:
    """From a config.json, a model folder holding one, or a GGUF file (its header only)."""
    path = Path(path)
    config_json = path / "config.json" if path.is_dir() else path
    if config_json.suffix == ".json":
        try:
            raw = json.loads(config_json.read_text())
        except FileNotFoundError:
            raise ModelFileError(str(config_json), "config file does not exist") from None
        except json.JSONDecodeError as exc:
            raise ModelFileError(str(config_json), f"invalid JSON: {exc}") from None
        name = str(raw.get("_name_or_path") or config_json.parent.name or config_json.stem)
        try:
            return ModelShape.from_hf_config(raw, name)
        except KeyError as exc:
            raise ModelFileError(str(config_json), f"missing key {exc}") from None
    from shared.modelfile.gguf_meta import read_gguf_config

    return ModelShape.from_config(read_gguf_config(path), path.stem)
