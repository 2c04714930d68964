"""The interface between the HTTP layer and whatever runs the model.

The OpenAI surface never talks to workers itself: it hands a tokenized, validated
`GenerationRequest` to a `GenerationBackend` and relays the `GenerationChunk`s it yields. The
production backend speaks gRPC to prefill/decode worker pools; `EngineBackend`
(`services.inprocess`, outside this package: it imports the engine) runs one engine in-process
(single-process runs and tests).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from shared.sampling.logprob import TokenLogprob
from shared.sampling.params import SamplingParams
from shared.tokenizer.tokenizer import Tokenizer


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


@dataclass
class GenerationChunk:
    """What one engine step produced for one request (token ids, text delta, counters)."""

    token_ids: list[int]
    text: str  # delta, safe to show (no partial stop string, no broken UTF-8)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None  # on the first chunk, when asked for
    # Top alternatives per prompt position (first entry None), when the backend has them;
    # without them a completions `echo` reports `top_logprobs` null for prompt tokens.
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0  # cumulative
    replica: str | None = None  # which worker(s) served it
    # Anything else the backend wants on the response's `metadata` (routing attempts,
    # reasoning); merged into it as-is, later chunks overriding earlier keys.
    metadata: dict[str, Any] | None = None


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
        """Stream the request's chunks; the last one has `finished=True`.

        Raises BackendUnavailable / BackendError / BackendRequestError, either before the
        first chunk or mid-stream. Closing or cancelling the iterator before the last chunk
        (the client went away) must abort the request in the backend.
        """
        ...

    async def health(self) -> dict[str, Any]:
        """At least {"ready": bool}; anything else is reported on /ready as-is."""
        ...
