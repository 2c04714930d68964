"""W3C trace context in and out: HTTP headers at the coordinator, gRPC metadata between
services. A malformed `traceparent` is ignored (the propagator returns no parent), so the
request simply starts a new trace."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACE_ID_HEADER = "x-trace-id"

# Stateless: one instance serves every call.
_W3C = TraceContextTextMapPropagator()


def context_from_headers(headers: Mapping[str, str]) -> otel_context.Context:
    return _W3C.extract(headers)


def context_from_grpc(metadata: Iterable[tuple[str, str | bytes]] | None) -> otel_context.Context:
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    return _W3C.extract(carrier)


def grpc_metadata(span: trace.Span) -> tuple[tuple[str, str], ...]:
    """Metadata carrying `span` as the parent of whatever the callee starts."""
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items())


def trace_id_of(span: trace.Span) -> str | None:
    ctx = span.get_span_context()
    return f"{ctx.trace_id:032x}" if ctx.is_valid else None


def response_headers(span: trace.Span) -> dict[str, str]:
    """`x-trace-id` and `traceparent` for a response, so a client can find its trace."""
    carrier: dict[str, str] = {}
    _W3C.inject(carrier, context=trace.set_span_in_context(span))
    trace_id = trace_id_of(span)
    if trace_id is None:
        return {}
    return {TRACE_ID_HEADER: trace_id, **carrier}


def current_trace_metadata() -> dict[str, str]:
    """{"trace_id": ...} for a response's `metadata`, from the span active in this context."""
    trace_id = trace_id_of(trace.get_current_span())
    return {"trace_id": trace_id} if trace_id else {}
