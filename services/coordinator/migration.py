"""Request migration: what a stream has produced so far, and how to continue it elsewhere.

When a replica dies mid-request, the coordinator re-issues the original prompt plus every
token already streamed as the new prompt, with the output budget reduced by what was
streamed, to a freshly routed pair. The client's stream, its detokenizer and its stop-string
tracker carry on untouched, so the client sees one uninterrupted reply.

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
from typing import Any

import grpc

from shared.sampling.params import SamplingParams

DEFAULT_MAX_MIGRATIONS = 2

# A replica that answers with one of these is gone (or going): the request moves elsewhere.
LOST_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)


class ReplicaLost(Exception):
    """A replica of the pair died (or left the stream unfinished) while serving a request."""

    def __init__(self, worker_id: str, reason: str):
        super().__init__(f"replica {worker_id} lost: {reason}")
        self.worker_id = worker_id
        self.reason = reason


@dataclass(frozen=True)
class Migration:
    from_replica: str  # the pair that failed, as routing described it
    to_replica: str
    after_tokens: int  # output tokens the client had received when it moved
    reason: str

    def as_metadata(self) -> dict[str, Any]:
        return {
            "from": self.from_replica,
            "to": self.to_replica,
            "after_tokens": self.after_tokens,
            "reason": self.reason,
        }


@dataclass
class StreamProgress:
    """One request's output so far, across every replica pair that served a part of it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_migrations: int
    streamed: list[int] = field(default_factory=list)
    migrations: list[Migration] = field(default_factory=list)

    @property
    def attempt(self) -> int:
        return len(self.migrations)

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.streamed)

    @property
    def can_migrate(self) -> bool:
        return self.attempt < self.max_migrations

    def attempt_request_id(self) -> str:
        # A fresh id per attempt: the old one may still be tombstoned or parked somewhere.
        return self.request_id if self.attempt == 0 else f"{self.request_id}~m{self.attempt}"

    def attempt_prompt(self) -> list[int]:
        return self.prompt_token_ids + self.streamed

    def attempt_params(self) -> SamplingParams:
        if self.attempt == 0:
            return self.params
        return replace(self.params, max_tokens=self.remaining_tokens)

    def record(self, from_replica: str, to_replica: str, reason: str) -> Migration:
        migration = Migration(from_replica, to_replica, len(self.streamed), reason)
        self.migrations.append(migration)
        return migration

    def give_up_message(self, lost: ReplicaLost) -> str:
        return (
            f"request {self.request_id}: {lost}; after {len(self.streamed)} tokens it was "
            f"migrated {self.attempt} times; giving up"
        )

    def metadata(self) -> list[dict[str, Any]]:
        return [m.as_metadata() for m in self.migrations]
