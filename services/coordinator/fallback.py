"""Trying a request's models in order until one produces its first token in time.

Each attempt streams from the backend; if the first token misses the TTFT deadline, or the
attempt fails before it (5xx, no replica, transfer failure), its stream is closed (which
aborts the request on the workers) and the next model is tried. The last model has no
deadline: there is nothing left to fall back to, so waiting is better than failing. Once a
token is out the attempt is committed; surviving a replica that dies later is migration's job.

Each attempt's token ids become text here (`with_text`, with that model's tokenizer), so a
stop string ends the attempt's stream, and with it the request on the workers.

Every chunk passed on carries `attempts` and `reasoning` in its metadata, so the first and
last chunks of a stream (and a whole response) say which models were tried and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from services.coordinator.backend import (
    BackendError,
    BackendUnavailable,
    GenerationBackend,
    GenerationChunk,
    GenerationRequest,
    ModelInfo,
)
from services.coordinator.text_stream import with_text


@dataclass
class Attempt:
    model: str
    replica: str | None = None
    ttft_ms: float | None = None
    success: bool = False
    error: str | None = None


@dataclass(frozen=True)
class FallbackPolicy:
    models: list[str]
    ttft_timeout_ms: float | None = None  # None: fall back only on failures
    reasoning: list[str] = field(default_factory=list)  # from choosing the models


class _MissedDeadline(Exception):
    pass


class FallbackBackend:
    """A `GenerationBackend` view of `backend` that serves each request under `policy`."""

    def __init__(self, backend: GenerationBackend, policy: FallbackPolicy):
        self.backend = backend
        self.policy = policy
        self._tokenizers = {m.id: m.tokenizer for m in backend.models()}

    def models(self) -> list[ModelInfo]:
        return self.backend.models()

    async def health(self) -> dict[str, Any]:
        return await self.backend.health()

    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        models = self.policy.models
        attempts: list[Attempt] = []
        reasoning = list(self.policy.reasoning)
        for index, model in enumerate(models):
            last = index == len(models) - 1
            attempt = Attempt(model)
            attempts.append(attempt)
            sub = replace(
                req,
                model=model,
                request_id=req.request_id if index == 0 else f"{req.request_id}-fallback{index}",
            )
            timeout_s = (
                None
                if last or self.policy.ttft_timeout_ms is None
                else (self.policy.ttft_timeout_ms / 1000)
            )
            started = time.monotonic()
            stream = self.backend.generate(sub)
            tokenizer = self._tokenizers.get(model)
            if tokenizer is not None:  # else the backend refuses the model before any token
                stream = with_text(stream, tokenizer, sub.params.stop)
            async with contextlib.aclosing(stream):
                try:
                    head = await _until_first_token(stream, timeout_s)
                except _MissedDeadline:
                    attempt.error = f"no first token within {self.policy.ttft_timeout_ms:g} ms"
                    reasoning.append(
                        f"fallback: {model} missed the {self.policy.ttft_timeout_ms:g} ms TTFT "
                        f"deadline; cancelled, trying {models[index + 1]}"
                    )
                    continue
                except (BackendError, BackendUnavailable) as exc:
                    attempt.error = f"{type(exc).__name__}: {exc}"
                    if last:
                        raise
                    reasoning.append(
                        f"fallback: {model} failed before its first token ({attempt.error}); "
                        f"trying {models[index + 1]}"
                    )
                    continue
                attempt.ttft_ms = round((time.monotonic() - started) * 1000, 3)
                attempt.success = True
                if len(models) > 1:
                    reasoning.append(f"fallback: serving with {model} (attempt {index + 1})")
                for chunk in head:
                    yield _annotate(chunk, model, attempts, reasoning)
                if head[-1].finished:
                    return
                async for chunk in stream:
                    # Only the last chunk needs the metadata again (the stream's last event).
                    yield _annotate(chunk, model, attempts, reasoning) if chunk.finished else chunk
                    if chunk.finished:
                        return
                return
        raise AssertionError("unreachable: the last model has no deadline")  # pragma: no cover


async def _until_first_token(
    stream: AsyncIterator[GenerationChunk], timeout_s: float | None
) -> list[GenerationChunk]:
    """The chunks up to and including the first with a token (or the finishing one)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    head: list[GenerationChunk] = []
    while True:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            if remaining is None:
                chunk = await anext(stream)
            else:
                chunk = await asyncio.wait_for(anext(stream), remaining)
        except TimeoutError:
            raise _MissedDeadline() from None
        except StopAsyncIteration:
            raise BackendError("the backend ended the stream before the first token") from None
        head.append(chunk)
        if chunk.token_ids or chunk.finished:
            return head


def _annotate(
    chunk: GenerationChunk, model: str, attempts: list[Attempt], reasoning: list[str]
) -> GenerationChunk:
    meta = dict(chunk.metadata or {})
    for line in meta.get("routing") or []:
        if f"{model}: {line}" not in reasoning:
            reasoning.append(f"{model}: {line}")
    attempts[-1].replica = chunk.replica or attempts[-1].replica
    meta["model"] = model
    meta["attempts"] = [asdict(a) for a in attempts]
    meta["reasoning"] = list(reasoning)
    chunk.metadata = meta
    return chunk
