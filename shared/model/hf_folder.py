"""Read a Hugging Face Llama folder: config.json plus *.safetensors shards."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from shared.model.gguf_file import Checkpoint, expected_tensor_names
from shared.modelfile.config import ModelConfig, ModelFileError

_HF_LAYER_NAMES = {
    "input_layernorm": "input_norm",
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "o_proj",
    "post_attention_layernorm": "post_attention_norm",
    "mlp.gate_proj": "gate_proj",
    "mlp.up_proj": "up_proj",
    "mlp.down_proj": "down_proj",
}


def read_hf_folder(folder: str | os.PathLike) -> Checkpoint:
    from safetensors.torch import load_file

    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelFileError(str(folder), "no config.json in the model folder")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelFileError(str(config_path), f"invalid JSON: {exc}") from exc
    model_type = raw.get("model_type", "llama")
    if model_type not in ("llama", "mistral"):
        raise ModelFileError(str(config_path), f"unsupported model_type '{model_type}'")
    try:
        config = ModelConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=int(raw["num_attention_heads"]),
            num_kv_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            max_position=int(raw.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            head_dim_override=raw.get("head_dim"),
        )
    except KeyError as exc:
        raise ModelFileError(str(config_path), f"missing key {exc}") from exc
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ModelFileError(str(folder), "no *.safetensors files in the model folder")
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            state = load_file(str(shard))
        except Exception as exc:
            raise ModelFileError(str(shard), f"unreadable safetensors file: {exc}") from exc
        for hf_name, value in state.items():
            name = _our_name(hf_name)
            if name is not None:
                tensors[name] = value.to(torch.float32).contiguous()
    missing = [n for n in expected_tensor_names(config) if n not in tensors]
    if missing:
        raise ModelFileError(str(folder), f"missing tensors: {', '.join(missing[:5])}")
    return Checkpoint(config=config, tensors=tensors, source=str(folder))


def _our_name(hf_name: str) -> str | None:
    name = hf_name.removeprefix("model.")
    if name == "embed_tokens.weight":
        return "embed_tokens"
    if name == "norm.weight":
        return "norm"
    if hf_name == "lm_head.weight":
        return "lm_head"
    if name.startswith("layers."):
        _, layer, rest = name.split(".", 2)
        rest = rest.removesuffix(".weight")
        if rest in _HF_LAYER_NAMES:
            return f"layers.{layer}.{_HF_LAYER_NAMES[rest]}"
    return None
