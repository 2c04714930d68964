"""One generation request through the HTTP layer: parse, prepare, relay, count.

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

from services.coordinator.accumulate import ResponseState
from services.coordinator.admission import Admission, Ticket
from services.coordinator.backend import (
    BackendError,
    GenerationBackend,
    GenerationChunk,
)
from services.coordinator.errors import APIError, from_validation_error
from services.coordinator.failures import backend_api_error, error_response
from services.coordinator.http_body import read_json_object
from services.coordinator.metrics import UNKNOWN, APIMetrics
from services.coordinator.model_routes import ModelRoutes
from services.coordinator.prepare import Endpoint, PreparedRequest, prepare_chat, prepare_completion
from services.coordinator.prompt_tokens import PromptTokens
from services.coordinator.relay import (
    SSE_DONE,
    ChoiceStreams,
    ClientDisconnected,
    SSEResponse,
    sse,
    until_disconnect,
)
from services.coordinator.response_format import ChatFormat, CompletionFormat, ResponseFormat
from services.coordinator.retry import RetryLoop
from services.coordinator.schemas import ChatCompletionRequest, CompletionRequest
from services.coordinator.settings import APISettings
from services.coordinator.targets import resolve_targets
from services.coordinator.unsupported import refuse_unsupported
from shared.telemetry.http_span import RequestTrace
from shared.telemetry.tracing import Tracing
from shared.training_log import LoggedTurn, TrainingLogWriter

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's code for "the client closed the connection first"

# Bodies up to this size are prepared on the event loop: tokenizing one (~750 tokens at most,
# fewer uncached) takes about half a millisecond, and the hop to a worker thread and back
# costs the request a fifth of that and more under load.
INLINE_PREPARE_MAX_BYTES = 4 << 10


@dataclass(frozen=True)
class _EndpointSpec:
    name: Endpoint
    schema: type[BaseModel]
    prepare: Callable[..., PreparedRequest]
    format: type[ResponseFormat]


ENDPOINTS = {
    "chat": _EndpointSpec("chat", ChatCompletionRequest, prepare_chat, ChatFormat),
    "completion": _EndpointSpec(
        "completion", CompletionRequest, prepare_completion, CompletionFormat
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
        self.model_routes = ModelRoutes(settings.model_routes)
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
        spec = ENDPOINTS[endpoint]
        progress = _Progress(trace=trace)
        ticket: Ticket | None = None
        streams: ChoiceStreams | None = None
        try:
            key = self.keyring.authenticate(request)
            data = await read_json_object(request, self.settings.max_body_bytes)
            refuse_unsupported(data, endpoint)
            try:
                body = spec.schema.model_validate(data)
            except ValidationError as exc:
                raise from_validation_error(exc) from exc
            tier = key.resolve_tier(body.service_tier)
            log.debug("request from key %s at tier %s", key.name, tier)  # the name, never the key
            policy, infos = resolve_targets(
                body,
                self.model_routes,
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
                prepared = spec.prepare(*prepare_args)
            else:  # tokenizing a long prompt must not hold the event loop
                prepared = await run_in_threadpool(spec.prepare, *prepare_args)
            _describe(trace, prepared, body)
            state = ResponseState(prepared, self.settings.prices.get(tier))
            try:
                ticket = self.admission.try_acquire(model.id, tier)
                if ticket is None:  # the model is at its in-flight limit: wait in the tier queue
                    with trace.queued(tier):
                        ticket = await until_disconnect(
                            request, self.admission.acquire(model.id, tier)
                        )
                loop = RetryLoop(self.backend, policy, model.tokenizer)
                streams = ChoiceStreams(loop, prepared.requests, hold_first=prepared.stream)
                if prepared.stream:
                    # Everything the response needs but its first token is built while the
                    # prefill runs, so the token only has to be formatted and written.
                    response = SSEResponse(
                        headers={"X-Request-Id": prepared.response_id, **trace.headers()},
                        on_close=lambda: _close(streams, ticket),
                    )
                    fmt = spec.format(prepared, state)
                    first = await until_disconnect(request, streams.next())
                else:
                    await until_disconnect(request, self._collect(streams, state, progress))
            except ClientDisconnected:
                _close(streams, ticket)
                self._count(progress, endpoint, CLIENT_CLOSED)
                return Response(status_code=CLIENT_CLOSED)
            except Exception as exc:
                _close(streams, ticket)
                raise backend_api_error(exc, prepared) from exc
            except BaseException:  # cancelled (server shutting down): still abort the work
                _close(streams, ticket)
                raise
        except APIError as exc:
            self._count(progress, endpoint, exc.status)
            return error_response(exc)
        except Exception:
            self._count(progress, endpoint, 500)  # a bug: the last-resort handler answers
            raise
        if prepared.stream:
            response.body_iterator = self._events(
                prepared, streams, first, state, fmt, progress, ticket
            )
            return response
        headers = {"X-Request-Id": prepared.response_id}
        fmt = spec.format(prepared, state)
        ticket.release()
        try:
            body = fmt.response()
        except Exception:
            self._count(progress, endpoint, 500)
            raise
        self._finish(progress, endpoint, state, 200)
        return JSONResponse(body, headers=headers)

    async def _collect(
        self, streams: ChoiceStreams, state: ResponseState, progress: _Progress
    ) -> None:
        while (event := await streams.next()) is not None:
            index, chunk = event
            self._observe(progress, index, chunk)
            state.add(index, chunk)
        _check_finished(state)

    async def _events(
        self,
        prepared: PreparedRequest,
        streams: ChoiceStreams,
        first: tuple[int, GenerationChunk] | None,
        state: ResponseState,
        fmt: ResponseFormat,
        progress: _Progress,
        ticket: Ticket,
    ) -> AsyncIterator[str]:
        outcome: int | str = CLIENT_CLOSED  # unless the stream gets to its end
        try:
            event = first
            while event is not None:
                index, chunk = event
                state.add(index, chunk)
                # One write for all of a chunk's events (the opening role chunk and the first
                # token travel together).
                x = "".join(sse(payload) for payload in fmt.stream_chunks(index, chunk))
                if x:
                    yield x
                # Written: the token's time is taken now, and its choice's backend goes on.
                self._observe(progress, index, chunk)
                if chunk.token_ids:
                    streams.written(index)
                event = await streams.next()
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
            _close(streams, ticket)  # no await: this may run inside a cancelled scope
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


def _close(streams: ChoiceStreams | None, ticket: Ticket | None) -> None:
    """Abort what the backend still runs for the request and give back its slot."""
    if streams is not None:
        streams.close()
    if ticket is not None:
        ticket.release()


def _check_finished(state: ResponseState) -> None:
    if not state.finished:
        raise BackendError("the backend ended the stream before the request finished")
