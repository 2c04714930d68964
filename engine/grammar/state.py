"""One request's position in its grammar: what it may emit next, and what it has emitted."""

from __future__ import annotations

from collections.abc import Sequence

import llguidance


class GrammarState:
    """Wraps an `llguidance.LLMatcher` started for one request.

    The matcher only ever consumes tokens the mask allowed, so a refusal is a bug (a mask
    not applied, or applied to the wrong row) and fails loudly with the matcher's reason.
    """

    def __init__(self, matcher: llguidance.LLMatcher, request_id: str = ""):
        self.matcher = matcher
        self.request_id = request_id

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(
                f"{self.request_id}: token {token} is outside the grammar "
                f"({self.matcher.get_error() or 'rejected'})"
            )

    def replay(self, tokens: Sequence[int]) -> bool:
        """Feed tokens generated earlier (a migrated request); False if they do not fit."""
        return self.matcher.try_consume_tokens(list(tokens)) == len(tokens)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar allows from here (the state is unchanged):
        a speculative draft is cut there before it is verified."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self.matcher.rollback(num_tokens):
            raise RuntimeError(f"{self.request_id}: grammar rollback of {num_tokens} failed")

    @property
    def is_finished(self) -> bool:
        """Nothing but a stop token may follow: the output is complete."""
        return self.matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()
