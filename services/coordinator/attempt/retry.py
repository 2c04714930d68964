"""The one retry loop: a request's attempts, each on one (model, prefill, decode), until one
finishes it.

- **Fallback** across the request's models: an attempt whose first token misses the TTFT
  deadline, or that fails before it (5xx, no replica, a replica lost with no migration
  left), is closed (which aborts it on the workers) and the next model is tried. The last
  model has no deadline: there is nothing left to fall back to, so waiting beats failing.
- **Migration** when a replica dies (`ReplicaLost`), before or after the first token: the
  next attempt goes to the same model on another pair, the dead replica excluded, and
  continues the client's stream from the tokens it already has (see `attempts`), at most
  `max_migrations` times. A draining replica whose grace ran out hands its streams over
  (`ReplicaHandedOver`): the same move, recorded as `drain`, and not counted against
  `max_migrations` (nothing failed). A failed KV transfer needs no new attempt: the decode replica
  prefills locally and the attempt goes on; its outcome is reported in `metadata.transfer`.

The client sees one stream: text comes from one detokenizer and one stop-string tracker
fed by every attempt, counters are relative to the client's prompt. The first chunk and the
last carry `model`, `attempts` (one entry per attempt, with its reason) and `reasoning`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from services.coordinator.attempt.progress import MOVES, Attempt, RequestProgress
from services.coordinator.generation_backend import (
    BackendError,
    BackendUnavailable,
    GenerationBackend,
    GenerationChunk,
    GenerationRequest,
    ReplicaHandedOver,
    ReplicaLost,
)
from services.coordinator.route.targets import RetryPolicy
from services.coordinator.stream.text import text_changes
from services.coordinator.stream.text_tracker import TextTracker
from shared.tokenizer.detokenizer import IncrementalDetokenizer
from shared.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class _MissedDeadline(Exception):
    pass


class RetryLoop:
    """Serves requests from `backend` under `policy`; `tokenizer` turns their ids into text."""

    def __init__(self, backend: GenerationBackend, policy: RetryPolicy, tokenizer: Tokenizer):
        self.backend = backend
        self.policy = policy
        self.tokenizer = tokenizer

    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        policy, models = self.policy, self.policy.models
        progress = RequestProgress(req)
        stream = _ClientStream(
            progress,
            TextTracker(IncrementalDetokenizer(self.tokenizer), req.params.stop),
            list(policy.reasoning),
            self.tokenizer.stop_token_ids | frozenset(req.params.stop_token_ids),
        )
        index, reason = 0, "first"
        lost: ReplicaLost | None = None  # the last replica lost, while migrating
        deadline: float | None = None
        while True:
            model, last_model = models[index], index == len(models) - 1
            attempt, sub = progress.begin(model, reason)
            started = time.monotonic()
            if reason not in MOVES:  # a move before the first token keeps the clock
                timeout = None if last_model else policy.ttft_timeout_ms
                deadline = None if timeout is None else started + timeout / 1000
            try:
                # aclosing: the attempt's cleanup (aborting it on the replicas) must run when
                # we stop, not whenever it is garbage-collected.
                async with contextlib.aclosing(self.backend.generate(sub)) as chunks:
                    head = await _head(chunks, None if progress.streamed else deadline)
                    attempt.ttft_ms = round((time.monotonic() - started) * 1000, 3)
                    attempt.success = True  # until it fails after all
                    for chunk in head:
                        out = stream.relay(chunk, attempt)
                        yield out
                        if out.finished:
                            return
                    async for chunk in chunks:
                        out = stream.relay(chunk, attempt)
                        yield out
                        if out.finished:
                            return
                return  # ended unfinished: the HTTP layer says so
            except _MissedDeadline:
                attempt.error = f"no first token within {policy.ttft_timeout_ms:g} ms"
                stream.reasoning.append(
                    f"fallback: {model} missed the {policy.ttft_timeout_ms:g} ms TTFT "
                    f"deadline; cancelled, trying {models[index + 1]}"
                )
                index, reason = index + 1, "fallback"
                continue
            except ReplicaLost as exc:
                handed_over = isinstance(exc, ReplicaHandedOver)
                if not handed_over:  # a hand-over ends the attempt's part; nothing failed
                    attempt.success, attempt.error = False, str(exc)
                progress.exclude.add(exc.worker_id)
                lost = exc
                if progress.remaining_tokens <= 0:  # lost right after the last token
                    yield stream.finish("length")
                    return
                if handed_over or progress.migrations < policy.max_migrations:
                    reason = "drain" if handed_over else "migration"
                    log.warning(
                        "request %s: %s after %d tokens; moving it (%s)",
                        req.request_id,
                        exc,
                        len(progress.streamed),
                        reason,
                    )
                    stream.reasoning.append(
                        f"{reason}: {exc} after {len(progress.streamed)} tokens; "
                        f"{model} goes on on another pair"
                    )
                    continue
                failure: Exception = BackendError(progress.give_up_message(exc))
                failure.__cause__ = exc
            except (BackendError, BackendUnavailable) as exc:
                attempt.success, attempt.error = False, f"{type(exc).__name__}: {exc}"
                failure = exc
                if reason in MOVES and lost is not None:
                    failure = BackendError(
                        f"{progress.give_up_message(lost)} (no healthy replica pair left for "
                        f"'{model}': {exc})"
                    )
                    failure.__cause__ = exc
            # This model failed for good: fall back unless the stream has begun.
            if progress.streamed or last_model:
                raise failure
            stream.reasoning.append(
                f"fallback: {model} failed before its first token ({attempt.error}); "
                f"trying {models[index + 1]}"
            )
            index, reason, lost = index + 1, "fallback", None


async def _head(
    chunks: AsyncIterator[GenerationChunk], deadline: float | None
) -> list[GenerationChunk]:
    """The chunks up to and including the first with a token (or the finishing one)."""
    head: list[GenerationChunk] = []
    while True:
        try:
            if deadline is None:
                chunk = await anext(chunks)
            else:
                chunk = await asyncio.wait_for(anext(chunks), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise _MissedDeadline() from None
        except StopAsyncIteration:
            raise BackendError("the backend ended the stream before the first token") from None
        head.append(chunk)
        if chunk.token_ids or chunk.finished:
            return head


class _ClientStream:
    """The client's one stream, from the chunks of successive attempts: text through one
    detokenizer and stop-string tracker, counters relative to the client's own prompt, the
    metadata of the attempt that streamed the first token (its prompt is the client's, so its
    cache hits, prompt logprobs and transfer are the ones to report). Each chunk comes out as
    a new value; the attempt's own is left as it was."""

    def __init__(
        self,
        progress: RequestProgress,
        tracker: TextTracker,
        reasoning: list[str],
        stop_token_ids: frozenset[int],
    ):
        self.progress = progress
        self.tracker = tracker
        self.reasoning = reasoning
        self.stop_token_ids = stop_token_ids  # hidden when a backend's "stop" ends on one
        self._origin: Attempt | None = None
        self._num_cached = 0
        self._annotated_head = False  # the client's first token has gone out, annotated
        self._seen: set[int] = set()  # attempts whose routing is in the reasoning
        self._last_replica: str | None = None

    def relay(self, chunk: GenerationChunk, attempt: Attempt) -> GenerationChunk:
        if self._origin is None and (chunk.token_ids or chunk.finished):
            self._origin = attempt
        origin = attempt is self._origin
        if chunk.metadata is not None or id(attempt) not in self._seen:
            self._note(attempt, chunk)
        if origin:
            self._num_cached = chunk.num_cached_tokens
        self.progress.streamed.extend(chunk.token_ids)
        return self._for_client(chunk, origin, attempt.after_tokens)

    def finish(self, reason: str) -> GenerationChunk:
        chunk = GenerationChunk(
            token_ids=[],
            finished=True,
            finish_reason=reason,
            num_output_tokens=len(self.progress.streamed),
            replica=self._last_replica,
        )
        return self._for_client(chunk, origin=True, after_tokens=0)

    def _note(self, attempt: Attempt, chunk: GenerationChunk) -> None:
        """The attempt's pair and routing, from its first chunk (or any with metadata)."""
        self._seen.add(id(attempt))
        meta = chunk.metadata or {}
        attempt.replica = meta.get("replica") or attempt.replica or chunk.replica
        for line in meta.get("routing") or ():
            line = f"{attempt.model}: {line}"
            if line not in self.reasoning:
                self.reasoning.append(line)

    def _for_client(
        self, chunk: GenerationChunk, origin: bool, after_tokens: int
    ) -> GenerationChunk:
        """The chunk as the client's stream carries it, in one copy: its text (a stop string
        finishes it, and the loop then returns), counters relative to the client's prompt and
        output, and only the origin attempt's metadata."""
        changes = text_changes(chunk, self.tracker, self.stop_token_ids)
        finished = changes.get("finished", chunk.finished)
        reason = changes.get("finish_reason", chunk.finish_reason) if finished else None
        if reason == "length" and self.progress.request.params.structured:
            # The grammar ends a complete value with "stop"; "length" means it is cut off.
            self.reasoning.append(
                "response_format: max_tokens ran out before the output was complete; it "
                "does not match the requested format"
            )
        self._last_replica = chunk.replica or self._last_replica
        metadata = chunk.metadata if origin else None
        if not self._annotated_head or finished:
            self._annotated_head = bool(changes.get("token_ids", chunk.token_ids)) or finished
            metadata = self._annotated(metadata)
        output = changes.get("num_output_tokens", chunk.num_output_tokens) + after_tokens
        changes.update(
            metadata=metadata,
            prompt_logprobs=chunk.prompt_logprobs if origin else None,
            finish_reason=reason,
            num_prompt_tokens=len(self.progress.request.prompt_token_ids),
            num_cached_tokens=self._num_cached,
            num_output_tokens=output,
        )
        return chunk.with_changes(**changes)

    def _annotated(self, metadata: dict[str, Any] | None) -> dict[str, Any]:
        """The chunk's metadata with the request's model, attempts and reasoning."""
        meta = dict(metadata or {})
        attempts = self.progress.attempts
        meta["model"] = (self._origin or attempts[-1]).model
        meta["attempts"] = self.progress.metadata()
        meta["reasoning"] = list(self.reasoning)
        return meta
