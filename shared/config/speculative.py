"""Speculative decoding settings of one model's decode replicas (part of the deployment schema)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.config import engine_defaults as defaults

SpecMethod = Literal["none", "ngram", "draft", "adaptive"]
MAX_SPECULATIVE_TOKENS = 16


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    method: SpecMethod = defaults.SPECULATIVE_METHOD
    num_speculative_tokens: int = Field(
        defaults.NUM_SPECULATIVE_TOKENS,
        description=f"most drafted tokens verified per step, 0..{MAX_SPECULATIVE_TOKENS}",
    )
    draft_path: str | None = Field(
        None, description="trained draft file; None = the default location beside the model"
    )
    draft_min_confidence: float = Field(
        defaults.DRAFT_MIN_CONFIDENCE,
        ge=0.0,
        le=1.0,
        description="a draft head's chain stops where its own acceptance estimate falls below",
    )
    draft_tree_width: int = Field(
        defaults.DRAFT_TREE_WIDTH,
        ge=1,
        le=4,
        description="a draft head's tree: nodes extended per depth and tokens per node "
        "(1 = chains); greedy rows only",
    )
    draft_tree_min_confidence: float = Field(
        defaults.DRAFT_TREE_MIN_CONFIDENCE,
        ge=0.0,
        le=1.0,
        description="a draft head's tree drops nodes whose path estimate falls below",
    )
    draft_tree_max_batch: int = Field(
        defaults.DRAFT_TREE_MAX_BATCH,
        ge=1,
        description="method draft: a draft head drafts trees while a step decodes at most "
        "this many sequences, chains beyond (adaptive prices k per step and drafts trees at "
        "any batch size)",
    )
    ngram_max: int = Field(defaults.NGRAM_MAX, ge=1, le=16)
    ngram_min: int = Field(defaults.NGRAM_MIN, ge=1, le=16)

    @field_validator("num_speculative_tokens")
    @classmethod
    def _k_range(cls, v: int) -> int:
        if not 0 <= v <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in 0..{MAX_SPECULATIVE_TOKENS}, got {v}"
            )
        return v

    @model_validator(mode="after")
    def _ngram_order(self) -> SpeculativeConfig:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) exceeds ngram_max ({self.ngram_max})")
        return self
