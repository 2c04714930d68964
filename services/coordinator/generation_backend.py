"""The interface between the HTTP layer and whatever runs the model.

The OpenAI surface never talks to workers itself: it hands a tokenized, validated
`GenerationRequest` to a `GenerationBackend` and relays the `GenerationChunk`s it yields,
through the retry loop (`retry`), which owns everything a request does across attempts:
fallback, migration, the text. One `generate` call is one attempt on one model. The
production backend speaks gRPC to prefill/decode worker pools; `EngineBackend`
(`tools.inprocess`, outside this package: it imports the engine) runs one engine in-process
(single-process runs and tests).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from shared.sampling.params import SamplingParams
from shared.tokenizer.tokenizer import Tokenizer
from shared.wire.records import GenerationChunk


@dataclass
class GenerationRequest:
    request_id: str
    model: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int  # from service_tier: priority 0, default 1, flex 2, batch 3
    service_tier: str
    prompt_logprobs: bool = False
    user: str | None = None
    # Replicas that already failed this request: a retry is routed around them.
    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ModelInfo:
    id: str
    context_length: int  # prompt + output tokens, the most one request may use
    tokenizer: Tokenizer
    owned_by: str = "splitserve"
    created: int = 0
    # Identifies the serving configuration (weights + tokenizer), echoed as
    # `system_fingerprint` so clients can tell when seeded output may change.
    fingerprint: str = ""


class BackendUnavailable(Exception):
    """No healthy replica can take the request now; the client should retry later."""

    def __init__(self, message: str = "no healthy replica is available", retry_after_s=1.0):
        super().__init__(message)
        self.retry_after_s = float(retry_after_s)


class BackendError(Exception):
    """A worker failed while serving the request (not the client's fault)."""


class ReplicaLost(Exception):
    """A replica serving the request died (or left its stream unfinished): the request can
    go on elsewhere (the retry loop excludes `worker_id` and tries again)."""

    def __init__(self, worker_id: str, reason: str):
        super().__init__(f"replica {worker_id} lost: {reason}")
        self.worker_id = worker_id
        self.reason = reason


class ReplicaHandedOver(ReplicaLost):
    """A draining replica ended the stream unfinished on purpose (its grace ran out) after
    freeing the request: it goes on elsewhere like after a loss, but nothing failed (the
    replica stays in the pool, finishing its drain, and the move is no failure to count)."""

    def __init__(self, worker_id: str, reason: str):
        Exception.__init__(self, f"replica {worker_id} handed the request over: {reason}")
        self.worker_id = worker_id
        self.reason = reason


class BackendRequestError(Exception):
    """The backend refused the request for a reason the client caused (e.g. the output does
    not fit the replica's KV cache). `param` names the offending engine parameter."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message


@runtime_checkable
class GenerationBackend(Protocol):
    def models(self) -> list[ModelInfo]:
        """The models served, with context length and tokenizer (used to tokenize here)."""
        ...

    def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream the request's chunks (token ids and counters; text is optional: the retry
        loop detokenizes); the last one has `finished=True`.

        Raises BackendUnavailable / BackendError / BackendRequestError, either before the
        first chunk or mid-stream, and ReplicaLost when the request may go on elsewhere.
        Closing or cancelling the iterator before the last chunk (the client went away) must
        abort the request in the backend.
        """
        ...

    async def health(self) -> dict[str, Any]:
        """At least {"ready": bool}; anything else is reported on /ready as-is."""
        ...
