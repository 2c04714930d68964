"""What one worker message carried for a request, before text: the unit a `PairAttempt`
yields and the client stream turns into chunks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.sampling.logprob import TokenLogprob


@dataclass
class Piece:
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int  # cumulative within this attempt
    replica: str
    prompt_logprobs: list[float | None] | None = None
    transfer: dict[str, Any] | None = None  # the KV push's outcome, once the prefill sent it
