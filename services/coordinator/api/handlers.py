"""One generation request through the HTTP layer: prepare, admit, serve, count.

Errors before the first token become plain HTTP errors (the stream has not begun, so a 503
with Retry-After is still possible); errors after it become an SSE error event and [DONE].
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from services.coordinator.api.disconnect import ClientDisconnected, until_disconnect
from services.coordinator.api.failures import backend_api_error, error_response
from services.coordinator.api.http_body import read_json_object
from services.coordinator.api.http_span import RequestTrace
from services.coordinator.api.metrics import UNKNOWN, APIMetrics
from services.coordinator.api.unsupported import refuse_unsupported
from services.coordinator.attempt.retry import RetryLoop
from services.coordinator.errors import APIError, from_validation_error
from services.coordinator.generation_backend import (
    BackendError,
    GenerationBackend,
    GenerationChunk,
)
from services.coordinator.prepare.prepared import (
    Endpoint,
    PreparedRequest,
    prepare_chat,
    prepare_completion,
)
from services.coordinator.prepare.prompt_tokens import PromptTokens
from services.coordinator.prepare.schemas import ChatCompletionRequest, CompletionRequest
from services.coordinator.route.admission import Admission, Ticket
from services.coordinator.route.saved_routers import SavedRouters
from services.coordinator.route.targets import RetryPolicy, resolve_targets
from services.coordinator.settings import APISettings
from services.coordinator.stream.accumulate import ResponseState, shown
from services.coordinator.stream.choices import ChoiceStreams
from services.coordinator.stream.formatting import (
    ChatFormatter,
    CompletionFormatter,
    ResponseFormatter,
)
from services.coordinator.stream.sse import SSE_DONE, SSEResponse, sse
from shared.telemetry.tracing import Tracing
from shared.training_log import LoggedTurn, TrainingLogWriter

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's code for "the client closed the connection first"

# Bodies up to this size are prepared on the event loop: tokenizing one (~750 tokens at most,
# fewer uncached) takes about half a millisecond, and the hop to a worker thread and back
# costs the request a fifth of that and more under load.
INLINE_PREPARE_MAX_BYTES = 4 << 10


@dataclass(frozen=True)
class _Endpoint:
    """What differs between the two generation endpoints."""

    name: Endpoint
    schema: type[BaseModel]
    prepare: Callable[..., PreparedRequest]
    format: type[ResponseFormatter]


ENDPOINTS = {
    "chat": _Endpoint("chat", ChatCompletionRequest, prepare_chat, ChatFormatter),
    "completion": _Endpoint(
        "completion", CompletionRequest, prepare_completion, CompletionFormatter
    ),
}


@dataclass
class _Progress:
    """Timing and labels of one request, for the metrics."""

    started: float = field(default_factory=time.monotonic)
    model: str = UNKNOWN
    tier: str = UNKNOWN
    first_token: float | None = None
    last_token: dict[int, float] = field(default_factory=dict)
    trace: RequestTrace | None = None  # ended with the request's outcome, in `_count`


@dataclass
class _Serving:
    """What a request holds while it is served, given back together however it ends: its
    admission ticket and its choices' streams (closing those aborts the work on the workers)."""

    ticket: Ticket | None = None
    streams: ChoiceStreams | None = None

    def close(self) -> None:
        if self.streams is not None:
            self.streams.close()
        if self.ticket is not None:
            self.ticket.release()


class GenerationHandler:
    def __init__(
        self,
        backend: GenerationBackend,
        settings: APISettings,
        metrics: APIMetrics,
        tracing: Tracing | None = None,
    ):
        self.backend = backend
        self.settings = settings
        self.metrics = metrics
        self.tracing = tracing or Tracing.disabled()
        self.keyring = settings.keyring
        self.saved_routers = SavedRouters(settings.saved_routers)
        self.admission = Admission(settings.tiers)
        self._encoders: dict[str, PromptTokens] = {}  # per model: what conversations repeat
        log_config = settings.training_log
        self.training_log = (
            TrainingLogWriter(log_config.path, log_config.sample_ratio)
            if log_config is not None and log_config.enabled
            else None
        )

    async def handle(self, request: Request, endpoint: Endpoint) -> Response:
        trace = RequestTrace(
            self.tracing, request.headers, endpoint, request.method, request.url.path
        )
        with trace.active():  # backend calls started inside become child spans
            try:
                response = await self._handle(request, endpoint, trace)
            except BaseException as exc:
                trace.fail(exc)
                raise
        if not isinstance(response, SSEResponse):  # a stream has them from before its first token
            response.headers.update(trace.headers())
        return response

    async def _handle(self, request: Request, endpoint: Endpoint, trace: RequestTrace) -> Response:
        kind = ENDPOINTS[endpoint]
        progress = _Progress(trace=trace)
        try:
            prepared, policy = await self._prepare(request, kind, progress)
        except APIError as exc:
            self._count(progress, endpoint, exc.status)
            return error_response(exc)
        except Exception:
            self._count(progress, endpoint, 500)  # a bug: the last-resort handler answers
            raise
        state = ResponseState(prepared, self.settings.prices.get(prepared.tier))
        serving = _Serving()
        try:
            serving.ticket = await self._admit(request, prepared, trace)
            loop = RetryLoop(self.backend, policy, prepared.model.tokenizer)
            serving.streams = ChoiceStreams(
                loop.generate, prepared.requests, hold_first=prepared.stream
            )
            if prepared.stream:
                return await self._open_stream(request, kind, prepared, state, serving, progress)
            await until_disconnect(request, self._collect(serving.streams, state, progress))
        except ClientDisconnected:
            serving.close()
            self._count(progress, endpoint, CLIENT_CLOSED)
            return Response(status_code=CLIENT_CLOSED)
        except Exception as exc:
            serving.close()
            error = backend_api_error(exc, prepared)
            self._count(progress, endpoint, error.status)
            return error_response(error)
        except BaseException:  # cancelled (server shutting down): still abort the work
            serving.close()
            raise
        return self._reply(kind, prepared, state, serving, progress)

    async def _prepare(
        self, request: Request, kind: _Endpoint, progress: _Progress
    ) -> tuple[PreparedRequest, RetryPolicy]:
        """Who asks, what for, of which models: the request tokenized and limited. Every
        refusal is an APIError."""
        key = self.keyring.authenticate(request)
        data = await read_json_object(request, self.settings.max_body_bytes)
        refuse_unsupported(data, kind.name)
        try:
            body = kind.schema.model_validate(data)
        except ValidationError as exc:
            raise from_validation_error(exc) from exc
        tier = key.resolve_tier(body.service_tier)
        log.debug("request from key %s at tier %s", key.name, tier)  # the name, never the key
        policy, infos = resolve_targets(
            body,
            self.saved_routers,
            self.settings.model_id,
            self.backend.models(),
            self.settings.max_migrations,
        )
        model = infos[0]
        progress.model, progress.tier = model.id, tier
        encoder = self._encoders.get(model.id)
        if encoder is None:
            encoder = self._encoders[model.id] = PromptTokens(model.tokenizer)
        prepare_args = (body, model, encoder, self.settings, tier)
        if _prepares_quickly(request):  # a thread hop costs more than preparing it here
            prepared = kind.prepare(*prepare_args)
        else:  # tokenizing a long prompt must not hold the event loop
            prepared = await run_in_threadpool(kind.prepare, *prepare_args)
        if progress.trace is not None:
            _describe(progress.trace, prepared, body)
        return prepared, policy

    async def _admit(
        self, request: Request, prepared: PreparedRequest, trace: RequestTrace
    ) -> Ticket:
        """A slot among the model's requests in flight; at its limit, a wait in the service
        tier's queue."""
        model_id, tier = prepared.model.id, prepared.tier
        ticket = self.admission.try_acquire(model_id, tier)
        if ticket is not None:
            return ticket
        with trace.queued(tier):
            return await until_disconnect(request, self.admission.acquire(model_id, tier))

    async def _open_stream(
        self,
        request: Request,
        kind: _Endpoint,
        prepared: PreparedRequest,
        state: ResponseState,
        serving: _Serving,
        progress: _Progress,
    ) -> SSEResponse:
        """The event stream, built while the prefill runs, once its first event has come: the
        first token then only has to be formatted and written."""
        assert serving.streams is not None and progress.trace is not None
        response = SSEResponse(
            headers={"X-Request-Id": prepared.response_id, **progress.trace.headers()},
            on_close=serving.close,
        )
        fmt = kind.format(prepared, state)
        first = await until_disconnect(request, serving.streams.next())
        response.body_iterator = self._events(prepared, serving, first, state, fmt, progress)
        return response

    def _reply(
        self,
        kind: _Endpoint,
        prepared: PreparedRequest,
        state: ResponseState,
        serving: _Serving,
        progress: _Progress,
    ) -> Response:
        """The whole reply in one body, once every choice has finished."""
        headers = {"X-Request-Id": prepared.response_id}
        fmt = kind.format(prepared, state)
        serving.close()
        try:
            body = fmt.response()
        except Exception:
            self._count(progress, prepared.endpoint, 500)
            raise
        self._finish(progress, prepared.endpoint, state, 200)
        return JSONResponse(body, headers=headers)

    async def _collect(
        self, streams: ChoiceStreams, state: ResponseState, progress: _Progress
    ) -> None:
        while (event := await streams.next()) is not None:
            index, chunk = event
            chunk = shown(chunk, state.prepared)
            self._observe(progress, index, chunk)
            state.add(index, chunk)
        _check_finished(state)

    async def _events(
        self,
        prepared: PreparedRequest,
        serving: _Serving,
        first: tuple[int, GenerationChunk] | None,
        state: ResponseState,
        fmt: ResponseFormatter,
        progress: _Progress,
    ) -> AsyncIterator[str]:
        assert serving.streams is not None
        outcome: int | str = CLIENT_CLOSED  # unless the stream gets to its end
        try:
            event = first
            while event is not None:
                index, chunk = event
                chunk = shown(chunk, prepared)
                state.add(index, chunk)
                # One write for all of a chunk's events (the opening role chunk and the first
                # token travel together).
                x = "".join(sse(payload) for payload in fmt.stream_chunks(index, chunk))
                if x:
                    yield x
                # Written: the token's time is taken now; asking for the next event lets its
                # choice's backend go on (the first-token hold, `ChoiceStreams`).
                self._observe(progress, index, chunk)
                event = await serving.streams.next()
            _check_finished(state)
            if prepared.include_usage:
                yield sse(fmt.usage_chunk())
            yield SSE_DONE
            outcome = 200
        except Exception as exc:
            error = backend_api_error(exc, prepared)
            outcome = "stream_error"
            yield sse(error.body())
            yield SSE_DONE
        finally:
            serving.close()  # no await: this may run inside a cancelled scope
            self._finish(progress, prepared.endpoint, state, outcome)

    def _observe(self, progress: _Progress, index: int, chunk: GenerationChunk) -> None:
        if not chunk.token_ids:
            return
        now = time.monotonic()
        labels = (progress.model, progress.tier)
        if progress.first_token is None:
            progress.first_token = now
            self.metrics.ttft.labels(*labels).observe(now - progress.started)
            if progress.trace is not None:
                progress.trace.first_token()
        previous = progress.last_token.get(index)
        if previous is not None:
            gap = (now - previous) / len(chunk.token_ids)
            for _ in chunk.token_ids:
                self.metrics.itl.labels(*labels).observe(gap)
        progress.last_token[index] = now

    def _finish(
        self, progress: _Progress, endpoint: str, state: ResponseState, outcome: int | str
    ) -> None:
        usage = state.usage()
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        self.metrics.count_tokens(
            progress.model,
            progress.tier,
            usage["prompt_tokens"],
            cached,
            usage["completion_tokens"],
        )
        if outcome == 200:
            elapsed = time.monotonic() - progress.started
            self.metrics.e2e.labels(progress.model, progress.tier).observe(elapsed)
        if outcome == 200 and self.training_log is not None and self.training_log.sampled():
            self._log_for_training(state, progress.tier)
        metadata = state.structured_metadata()  # counted by metrics and spans as lists
        if progress.trace is not None:
            progress.trace.record_result(
                input_tokens=usage["prompt_tokens"],
                output_tokens=usage["completion_tokens"],
                cached_tokens=cached,
                finish_reasons=[c.finish_reason for c in state.choices if c.finish_reason],
                metadata=metadata,
                outputs=[c.text for c in state.choices],
            )
        self._count(progress, endpoint, outcome, metadata)

    def _log_for_training(self, state: ResponseState, tier: str) -> None:
        """Token ids only, to the training log alone: never to spans or the ordinary log."""
        prepared = state.prepared
        if prepared.drop_output:
            return
        assert self.training_log is not None
        turns = [
            LoggedTurn(
                model=state.served_model,
                tier=tier,
                prompt_token_ids=list(prepared.prompt_ids[prepared.prompt_index(i)]),
                completion_token_ids=list(choice.token_ids),
            )
            for i, choice in enumerate(state.choices)
        ]
        try:
            self.training_log.write(turns)
        except OSError as exc:
            # A full disk must not fail a request that was served; say so without content.
            log.warning("training log %s not written: %s", self.training_log.path, exc)

    def _count(
        self,
        progress: _Progress,
        endpoint: str,
        status: int | str,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        self.metrics.count_request(progress.model, progress.tier, endpoint, status)
        self.metrics.count_outcome(progress.model, progress.tier, status, metadata or {})
        if progress.trace is not None:
            progress.trace.end(status)


def _describe(trace: RequestTrace, prepared: PreparedRequest, body: BaseModel) -> None:
    params = prepared.requests[0].params if prepared.requests else None
    trace.describe(
        model=prepared.model.id,
        tier=prepared.tier,
        stream=prepared.stream,
        response_id=prepared.response_id,
        choices=len(prepared.requests),
        max_tokens=params.max_tokens if params else None,
        temperature=params.temperature if params else None,
        top_p=params.top_p if params else None,
        seed=params.seed if params else None,
    )
    if trace.capture_content:
        trace.record_input(body.model_dump(mode="json", include={"messages", "prompt"}))


def _prepares_quickly(request: Request) -> bool:
    length = request.headers.get("content-length")
    return length is not None and length.isdigit() and int(length) <= INLINE_PREPARE_MAX_BYTES


def _check_finished(state: ResponseState) -> None:
    if not state.finished:
        raise BackendError("the backend ended the stream before the request finished")
