"""Stop strings over streamed text.

The matcher sees the text as it is detokenized, in deltas of any size, and decides what is
safe to send to the client now. It behaves exactly as if the text arrived one character at
a time, so the outcome never depends on how the text was split:

- generation stops at the first moment any stop string is complete (the match that *ends*
  earliest; on a tie, the longer one), and everything before that match is emitted;
- a suffix that could still grow into a stop string is held back, so no part of the stop
  string that ends up matching is ever emitted.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stop: Sequence[str]):
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = tuple(stop)
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def held(self) -> str:
        """Text received but not yet emitted, because it may start a stop string."""
        return self._held

    def feed(self, delta: str) -> tuple[str, bool]:
        """Return ``(text safe to emit now, whether a stop string matched)``.

        After a match every later call returns ``("", True)``.
        """
        if self._stopped:
            return "", True
        text = self._held + delta
        match_start = self._earliest_match(text)
        if match_start is not None:
            self._stopped = True
            self._held = ""
            return text[:match_start], True
        keep = self._partial_suffix_len(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """Release held-back text when generation ends without a stop-string match."""
        if self._stopped:
            return ""
        text, self._held = self._held, ""
        return text

    def _earliest_match(self, text: str) -> int | None:
        # The held part never contains a whole stop string (it would have matched already),
        # so every match found here completes inside this delta and the text-order choice
        # equals the arrival-order choice.
        best: tuple[int, int] | None = None  # (end, -len) of the match to stop at
        best_start = None
        for s in self._stop:
            start = text.find(s)
            if start < 0:
                continue
            key = (start + len(s), -len(s))
            if best is None or key < best:
                best, best_start = key, start
        return best_start

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        if not text:
            return 0
        last = text[-1]
        longest = 0
        for s in self._stop:
            # Only prefixes ending in the text's last character can match; rfind jumps
            # between them instead of trying every length.
            end = s.rfind(last, 0, min(len(s) - 1, len(text)))
            while end + 1 > longest:
                if text.endswith(s[: end + 1]):
                    longest = end + 1
                    break
                end = s.rfind(last, 0, end)
        return longest
