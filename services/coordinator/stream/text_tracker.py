"""From generated token ids to the text a client may see: detokenized, cut at stop strings."""

from __future__ import annotations

from services.coordinator.stream.stop_strings import StopStringMatcher
from shared.tokenizer.detokenizer import IncrementalDetokenizer


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
