"""The coordinator's span for one API request: the root of the request's trace.

Started before the body is read (so a slow upload or a refusal shows), named and described
once the request is planned, ended when the last byte of the response is produced: for a
stream that is after the handler has returned, so ending is explicit, never a `with` block.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from shared.telemetry import attributes as A
from shared.telemetry.propagation import context_from_headers, response_headers
from shared.telemetry.tracing import Tracing

# Endpoint (as the handler names it) -> gen_ai.operation.name.
OPERATIONS = {"chat": "chat", "completion": "text_completion"}


class RequestTrace:
    def __init__(
        self, tracing: Tracing, headers: Mapping[str, str], endpoint: str, method: str, route: str
    ):
        self.capture_content = tracing.capture_content
        self._tracer = tracing.tracer
        self.operation = OPERATIONS.get(endpoint, endpoint)
        self.span = tracing.tracer.start_span(
            self.operation,
            context=context_from_headers(headers),
            kind=SpanKind.SERVER,
            attributes={
                A.OPERATION: self.operation,
                A.SYSTEM: A.SYSTEM_NAME,
                A.PROVIDER: A.SYSTEM_NAME,
                A.HTTP_METHOD: method,
                A.HTTP_ROUTE: route,
            },
        )
        self._ended = False

    @contextmanager
    def active(self) -> Iterator[None]:
        """Make the span current, so tasks started inside (the backend calls) are children."""
        token = otel_context.attach(trace.set_span_in_context(self.span))
        try:
            yield
        finally:
            otel_context.detach(token)

    def headers(self) -> dict[str, str]:
        return response_headers(self.span)

    @contextmanager
    def queued(self, tier: str) -> Iterator[None]:
        """A child span for the time the request waits in the coordinator's tier queue."""
        with self._tracer.start_as_current_span(
            A.SPAN_COORDINATOR_QUEUE,
            context=trace.set_span_in_context(self.span),
            attributes={A.TIER: tier},
        ):
            yield

    def describe(
        self,
        *,
        model: str,
        tier: str,
        stream: bool,
        response_id: str,
        choices: int,
        max_tokens: int | None,
        temperature: float | None,
        top_p: float | None,
        seed: int | None,
    ) -> None:
        if not self.span.is_recording():
            return
        self.span.update_name(f"{self.operation} {model}")
        values: dict[str, Any] = {
            A.REQUEST_MODEL: model,
            A.RESPONSE_MODEL: model,
            A.RESPONSE_ID: response_id,
            A.TIER: tier,
            A.STREAM: stream,
            A.REQUEST_CHOICES: choices,
            A.REQUEST_MAX_TOKENS: max_tokens,
            A.REQUEST_TEMPERATURE: temperature,
            A.REQUEST_TOP_P: top_p,
            A.REQUEST_SEED: seed,
        }
        self.span.set_attributes({k: v for k, v in values.items() if v is not None})

    def record_input(self, content: object) -> None:
        """The prompt or messages, only when the operator asked for content on spans."""
        if self.capture_content and self.span.is_recording():
            self.span.set_attribute(A.INPUT_MESSAGES, json.dumps(content, ensure_ascii=False))

    def first_token(self) -> None:
        self.span.add_event(A.EVENT_FIRST_TOKEN, timestamp=time.time_ns())

    def record_result(
        self,
        *,
        input_tokens: int,
        output_tokens: int,
        cached_tokens: int,
        finish_reasons: list[str],
        metadata: Mapping[str, Any],
        outputs: list[str],
    ) -> None:
        if not self.span.is_recording():
            return
        self.span.set_attributes(
            {
                A.USAGE_INPUT_TOKENS: input_tokens,
                A.USAGE_OUTPUT_TOKENS: output_tokens,
                A.CACHED_TOKENS: cached_tokens,
                A.RESPONSE_FINISH_REASONS: finish_reasons,
            }
        )
        if metadata.get("replica"):
            self.span.set_attribute(A.REPLICA, metadata["replica"])
        for key, name in A.METADATA_ATTRIBUTES.items():
            if key in metadata:
                self.span.set_attribute(name, _number(metadata[key]))
        attempts = _listed(metadata.get("attempts"))
        if len(attempts) > 1:  # every attempt after the first, by why it was made
            reasons = [a.get("reason") if isinstance(a, dict) else None for a in attempts]
            migrations = reasons.count("migration") + reasons.count("drain")  # drain: hand-over
            if len(attempts) - 1 - migrations:
                self.span.set_attribute(A.FALLBACK_ATTEMPTS, len(attempts) - 1 - migrations)
            if migrations:
                self.span.set_attribute(A.MIGRATIONS, migrations)
        if self.capture_content:
            self.span.set_attribute(A.OUTPUT_MESSAGES, json.dumps(outputs, ensure_ascii=False))

    def end(self, status: int | str) -> None:
        """End with the HTTP status (or "stream_error": it failed after the stream began)."""
        if self._ended:
            return
        self._ended = True
        if isinstance(status, int):
            self.span.set_attribute(A.HTTP_STATUS, status)
        if status == "stream_error" or (isinstance(status, int) and status >= 500):
            self.span.set_attribute(A.ERROR_TYPE, str(status))
            self.span.set_status(Status(StatusCode.ERROR, f"request ended with {status}"))
        self.span.add_event(A.EVENT_STREAM_END)
        self.span.end()

    def fail(self, exc: BaseException) -> None:
        """An exception escaped the handler (a bug, or the server shutting down)."""
        if self._ended:
            return
        self.span.record_exception(exc)
        self.span.set_attribute(A.ERROR_TYPE, type(exc).__name__)
        self._ended = True
        self.span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        self.span.end()


def _listed(value: Any) -> list:
    """A list from a response's metadata (JSON-encoded when it is string-valued)."""
    if isinstance(value, str) and value.startswith("["):
        try:
            value = json.loads(value)
        except ValueError:
            return []
    return list(value) if isinstance(value, list | tuple) else []


def _number(value: Any) -> int | str:
    """A count for a span attribute: lists (attempts, migrations; JSON-encoded when they
    come from a response's string-valued metadata) count their entries."""
    if isinstance(value, str) and value.startswith("["):
        try:
            value = json.loads(value)
        except ValueError:
            pass
    if isinstance(value, list | tuple):
        return len(value)
    try:
        return int(value)
    except (TypeError, ValueError):
        return str(value)
