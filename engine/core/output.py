"""What the engine reports per request per step: token ids and counters, never text (the
coordinator detokenizes and applies stop strings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.sampling.logprob import TokenLogprob


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # Set once, when the prompt completes (if asked): prompt tokens 1, 2, ... (token 0 has none).
    prompt_logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
