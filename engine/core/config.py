"""Knobs of one engine instance (one replica's model, cache and step loop)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.model.formats import SERVING_FORMATS
from shared.config import engine_defaults as defaults
from shared.config.engine_defaults import KV_CACHE_DTYPES, KVCacheDtype, PreemptionMode
from shared.config.speculative import MAX_SPECULATIVE_TOKENS, SpecMethod

# Scheduling priorities at or above this are background work (service tiers flex and batch).
BACKGROUND_PRIORITY = 2


@dataclass(frozen=True)
class EngineConfig:
    """Defaults are the deployment schema's, from shared/config/engine_defaults.py, except its
    LIBRARY_* ones (the weights, the KV dtype and the KV host tier; the reasons are there).
    tests/unit/test_config_defaults.py holds every shared field to that."""

    model: str | None = None  # GGUF file or HF folder; None = the bundled SmolLM2
    weights: str = defaults.LIBRARY_WEIGHTS  # one of SERVING_FORMATS; `auto` is measured
    block_size: int = defaults.BLOCK_SIZE
    kv_cache_bytes: int = defaults.KV_CACHE_BYTES
    kv_cache_dtype: KVCacheDtype = defaults.LIBRARY_KV_CACHE_DTYPE  # auto | float32 | float16
    num_blocks: int | None = None  # overrides kv_cache_bytes when set (tests)
    host_cache_bytes: int = defaults.LIBRARY_HOST_CACHE_BYTES  # KV host tier; 0 disables it
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = defaults.DISK_CACHE_BYTES  # KV disk tier; needs host tier and dir
    max_num_batched_tokens: int = defaults.MAX_NUM_BATCHED_TOKENS  # chunked-prefill budget/step
    # Prompt chunks of background service tiers (priority >= BACKGROUND_PRIORITY) are cut to
    # this many tokens a step. None = no cap.
    background_chunk_tokens: int | None = defaults.BACKGROUND_CHUNK_TOKENS
    # While a step carries decode rows, its prompt chunks total at most this many tokens
    # (why 128: engine_defaults). Chunking never changes the output. None = no cap.
    chunk_tokens_while_decoding: int | None = defaults.CHUNK_TOKENS_WHILE_DECODING
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    max_model_len: int | None = None  # defaults to the model's context length
    preemption_mode: PreemptionMode = defaults.PREEMPTION_MODE
    num_threads: int | None = None
    device: str = "cpu"
    seed: int = 0
    # Speculative decoding (decode phase only): see engine/speculative.
    speculative_method: SpecMethod = defaults.SPECULATIVE_METHOD
    num_speculative_tokens: int = defaults.NUM_SPECULATIVE_TOKENS
    draft_path: str | None = None  # None = draft_path_for(model)
    draft_min_confidence: float = defaults.DRAFT_MIN_CONFIDENCE
    draft_tree_width: int = defaults.DRAFT_TREE_WIDTH
    draft_tree_min_confidence: float = defaults.DRAFT_TREE_MIN_CONFIDENCE
    draft_tree_max_batch: int = defaults.DRAFT_TREE_MAX_BATCH
    ngram_max: int = defaults.NGRAM_MAX
    ngram_min: int = defaults.NGRAM_MIN

    def __post_init__(self) -> None:
        if self.weights not in SERVING_FORMATS:
            raise ValueError(
                f"weights must be one of {', '.join(SERVING_FORMATS)}, got {self.weights!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.background_chunk_tokens is not None and self.background_chunk_tokens < 1:
            raise ValueError("background_chunk_tokens must be >= 1 (or None for no cap)")
        if self.chunk_tokens_while_decoding is not None and self.chunk_tokens_while_decoding < 1:
            raise ValueError("chunk_tokens_while_decoding must be >= 1 (or None for no cap)")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}"
            )
        if self.preemption_mode == "swap" and self.host_cache_bytes <= 0:
            raise ValueError("preemption_mode 'swap' needs host_cache_bytes > 0")
        if self.disk_cache_bytes > 0 and (self.host_cache_bytes <= 0 or not self.disk_cache_dir):
            raise ValueError("a disk cache tier needs host_cache_bytes > 0 and disk_cache_dir")
        if self.speculative_method not in ("none", "ngram", "draft", "adaptive"):
            raise ValueError(
                "speculative_method must be none, ngram, draft or adaptive, "
                f"got {self.speculative_method!r}"
            )
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in 0..{MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )
        if not 0.0 <= self.draft_min_confidence <= 1.0:
            raise ValueError(
                f"draft_min_confidence must be in 0..1, got {self.draft_min_confidence}"
            )
        if not 1 <= self.draft_tree_width <= 4:
            raise ValueError(f"draft_tree_width must be in 1..4, got {self.draft_tree_width}")
        if not 0.0 <= self.draft_tree_min_confidence <= 1.0:
            raise ValueError(
                f"draft_tree_min_confidence must be in 0..1, got {self.draft_tree_min_confidence}"
            )
        if self.draft_tree_max_batch < 1:
            raise ValueError(
                f"draft_tree_max_batch must be at least 1, got {self.draft_tree_max_batch}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                "ngram sizes need 1 <= ngram_min <= ngram_max, "
                f"got {self.ngram_min}..{self.ngram_max}"
            )
