"""A request's attempts: which (model, prefill, decode) tried it, why, and how it ended;
what the next attempt asks for.

Every attempt after the first has a reason: `fallback` (the previous model missed its TTFT
deadline or failed before its first token), `migration` (a replica died; the request goes
on elsewhere, excluding it) or `drain` (a draining replica handed it over when its grace ran
out; it goes on elsewhere the same way, but nothing failed). An attempt that starts after
tokens were streamed is a continuation: the client's prompt plus every token already
streamed is its prompt, and the output budget is what is left, so the client's stream goes
on as one reply.

What a continuation preserves:
- Greedy (temperature 0): exact, token for token, except with frequency/presence penalties
  (they count generated tokens only, and the continuation's engine sees the streamed tokens
  as prompt). The repetition penalty counts prompt and output alike, so it carries over.
- Sampled requests: the distribution, the context and the remaining budget carry over. A
  seeded request keeps its seed, but the continuation's random stream restarts at the
  migration point: it is reproducible for the same migration point, not equal to the
  uninterrupted sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from services.coordinator.generation_backend import GenerationRequest

Reason = Literal["first", "fallback", "migration", "drain"]
# The reasons that continue the same model on another pair, from the tokens streamed so far.
MOVES: frozenset[Reason] = frozenset({"migration", "drain"})


def attempt_request_id(request_id: str, attempt: int) -> str:
    """The id the workers see for attempt `attempt` (0-based) of `request_id`: a fresh one
    per attempt, since an earlier attempt's may still be tombstoned or parked somewhere."""
    return request_id if attempt == 0 else f"{request_id}~{attempt}"


@dataclass
class Attempt:
    model: str
    reason: Reason
    after_tokens: int  # output tokens the client had when it began
    replica: str | None = None  # the pair, as routing described it ("prefill->decode")
    ttft_ms: float | None = None  # to its first token, for an attempt that began with none
    success: bool = False  # it streamed (its first token came in time) and did not fail after
    error: str | None = None

    def as_metadata(self) -> dict[str, Any]:
        # By hand, not `asdict`: this runs on the first and last chunk of every stream.
        return {
            "model": self.model,
            "reason": self.reason,
            "after_tokens": self.after_tokens,
            "replica": self.replica,
            "ttft_ms": self.ttft_ms,
            "success": self.success,
            "error": self.error,
        }


@dataclass
class RequestProgress:
    """One request's output so far, across every attempt that served a part of it."""

    request: GenerationRequest
    attempts: list[Attempt] = field(default_factory=list)
    streamed: list[int] = field(default_factory=list)
    exclude: set[str] = field(default_factory=set)  # replicas that failed it

    @property
    def remaining_tokens(self) -> int:
        return self.request.params.max_tokens - len(self.streamed)

    @property
    def migrations(self) -> int:
        """Moves after a replica failed: what `max_migrations` bounds (a hand-over by a
        draining replica is no failure of the request, and a request that keeps killing
        replicas is the one to stop)."""
        return sum(a.reason == "migration" for a in self.attempts)

    def begin(self, model: str, reason: Reason) -> tuple[Attempt, GenerationRequest]:
        """Records a new attempt on `model`; returns it and the request it sends."""
        attempt = Attempt(model, reason, len(self.streamed))
        self.attempts.append(attempt)
        req = self.request
        sub = replace(
            req,
            request_id=attempt_request_id(req.request_id, len(self.attempts) - 1),
            model=model,
            exclude=frozenset(self.exclude),
        )
        if self.streamed:
            sub.prompt_token_ids = req.prompt_token_ids + self.streamed
            # Fewer tokens left to generate; a structured output's grammar state is rebuilt
            # on the new replica from the tokens already streamed.
            sub.params = req.params.continued(len(self.streamed))
            # Prompt logprobs are the client's prompt's: asked of an attempt that starts it.
            sub.prompt_logprobs = False
        return attempt, sub

    def give_up_message(self, lost: Exception) -> str:
        moved = sum(a.reason in MOVES and a.replica is not None for a in self.attempts)
        return (
            f"request {self.request.request_id}: {lost}; after {len(self.streamed)} tokens it "
            f"was migrated {moved} times; giving up"
        )

    def metadata(self) -> list[dict[str, Any]]:
        return [a.as_metadata() for a in self.attempts]
