"""What the engine reports per request per step, and the text side of finishing (stop strings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.sampling.stop import StopStringMatcher
from shared.tokenizer.detokenizer import IncrementalDetokenizer


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text: str = ""  # text delta safe to show now (no partial stop string, no broken UTF-8)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None  # set once, when the prompt completes
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0


class TextTracker:
    """Per-request incremental detokenization plus stop-string matching."""

    def __init__(self, detokenizer: IncrementalDetokenizer, stop: tuple[str, ...]):
        self.detokenizer = detokenizer
        self.matcher = StopStringMatcher(stop) if stop else None

    def feed(self, token_ids: list[int]) -> tuple[str, bool]:
        """Text safe to emit, and whether a stop string was hit."""
        delta = self.detokenizer.add(token_ids)
        if self.matcher is None:
            return delta, False
        return self.matcher.feed(delta)

    def finish(self) -> str:
        tail = self.detokenizer.flush()
        if self.matcher is None:
            return tail
        emit, stopped = self.matcher.feed(tail)
        return emit if stopped else emit + self.matcher.flush()
