"""The records that cross a process boundary, one per message kind, as every side holds them.

`convert` turns each into its protobuf and back; nothing else copies them field by field.
(KV events have theirs beside the log that numbers them: `shared.kvblocks.events.KVEvent`.)
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from shared.sampling.logprob import TokenLogprob


@dataclass(frozen=True)
class GenerationChunk:
    """What one step produced for one request: token ids and counters from the worker's
    stream. A value: each stage of the coordinator that changes it (the pair attempt adds the
    transfer's outcome, the retry loop the text delta and the client's counters) makes a new
    one with `with_changes`."""

    token_ids: list[int]
    text: str = ""  # delta, safe to show (no partial stop string, no broken UTF-8)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # On the first chunk, when asked for: prompt tokens 1, 2, ... (token 0 has no context),
    # each with its logprob given the tokens before it and the top alternatives there.
    prompt_logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0  # cumulative
    replica: str | None = None  # which worker(s) served it
    # Anything else the backend wants on the response's `metadata` (routing, the KV push's
    # outcome); merged into it as-is, later chunks overriding earlier keys.
    metadata: dict[str, Any] | None = None

    def with_changes(self, **changes: Any) -> GenerationChunk:
        """A copy with `changes`. Not `dataclasses.replace`, which runs `__init__` through the
        frozen class's guarded setattr: 2.3 us a copy against 0.4 here, and every streamed
        chunk is copied on its way through the coordinator."""
        if not changes.keys() <= _CHUNK_FIELDS:
            unknown = sorted(changes.keys() - _CHUNK_FIELDS)
            raise TypeError(f"GenerationChunk has no field(s) {unknown}")
        copy = object.__new__(GenerationChunk)
        copy.__dict__.update(self.__dict__)
        copy.__dict__.update(changes)
        return copy


_CHUNK_FIELDS = frozenset(f.name for f in fields(GenerationChunk))


@dataclass(frozen=True)
class WorkerLoad:
    """What the router weighs about a replica, as its engine reported it (last heartbeat)."""

    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0  # prompt tokens waiting or mid-prefill
    active_kv_tokens: int = 0  # KV held by running sequences
    free_blocks: int = 0
    total_blocks: int = 0  # 0: the replica did not report its pool
