"""The coordinator's side of a request's worker calls: the routing decision, and a client
span per Prefill / Decode call whose context travels in the call's metadata, so the
worker's spans join the same trace as children."""

from __future__ import annotations

import time
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from shared.telemetry import attributes as A
from shared.telemetry.propagation import grpc_metadata

_RPC_SERVICE = "splitserve.worker.v1.Worker"


def describe_route(span: trace.Span, prefill_id: str | None, decode_id: str | None, reasoning):
    """Attributes of the routing span; ids are None when no replica was found."""
    if not span.is_recording():
        return
    values: dict[str, Any] = {
        A.ROUTE_MODE: "colocated" if prefill_id is None else "disaggregated",
        A.ROUTE_REASONING: list(reasoning or []),
    }
    if prefill_id:
        values[A.PREFILL_REPLICA] = prefill_id
    if decode_id:
        values[A.DECODE_REPLICA] = decode_id
    else:
        span.set_status(Status(StatusCode.ERROR, "no healthy replica"))
    span.set_attributes(values)


class RpcSpan:
    """A client span for one worker call; `end()` is idempotent (call it in `finally`)."""

    def __init__(self, tracer: trace.Tracer, name: str, method: str, replica: str, address: str):
        self.span = tracer.start_span(
            name,
            kind=SpanKind.CLIENT,
            attributes={
                A.RPC_SYSTEM: "grpc",
                A.RPC_SERVICE: _RPC_SERVICE,
                A.RPC_METHOD: method,
                A.REPLICA: replica,
                A.SERVER_ADDRESS: address,
            },
        )
        self.metadata = grpc_metadata(self.span)
        self._first: tuple[int, int, int] | None = None
        self._ended = False
        self._tokens = 0

    def record_first_token(self, first) -> None:
        """A PrefillFirstToken: when it came now; the prompt's tokens and cached ones go on
        the span when it ends (setting them here would delay the token's relay)."""
        if self.span.is_recording():
            self._first = (first.num_prompt_tokens, first.num_cached_tokens, time.time_ns())

    def record_transfer(self, t) -> None:
        """The TransferOutcome that ends a Prefill stream."""
        if not self.span.is_recording():
            return
        self.span.set_attributes(
            {
                A.TRANSFER_STATUS: t.status,
                A.TRANSFER_BACKEND: t.backend,
                A.TRANSFER_BYTES: t.nbytes,
                A.TRANSFER_SECONDS: t.seconds,
            }
        )

    def record_chunk(self, num_tokens: int, finished: bool, output_tokens: int) -> None:
        """One DecodeChunk: the first is marked; the last sets the totals and ends the span."""
        if not self.span.is_recording():
            if finished:
                self.end()
            return
        if self._tokens == 0 and num_tokens:
            self.span.add_event(A.EVENT_FIRST_TOKEN, timestamp=time.time_ns())
        self._tokens += num_tokens
        if finished:
            self.span.set_attribute(A.USAGE_OUTPUT_TOKENS, output_tokens)
            self.span.add_event(A.EVENT_STREAM_END, timestamp=time.time_ns())
            # The call is over for the request now; the generator that holds it may only be
            # closed later (when it is garbage-collected), which must not stretch the span.
            self.end()

    def fail(self, exc: BaseException) -> None:
        if isinstance(exc, grpc.aio.AioRpcError):
            self.span.set_attribute(A.RPC_GRPC_STATUS, exc.code().value[0])
            message = f"{exc.code().name}: {exc.details()}"
        else:
            message = f"{type(exc).__name__}: {exc}"
        self.span.set_attribute(A.ERROR_TYPE, type(exc).__name__)
        self.span.set_status(Status(StatusCode.ERROR, message))

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            if self._first is not None:
                prompt_tokens, cached, first_ns = self._first
                attributes = {A.USAGE_INPUT_TOKENS: prompt_tokens, A.CACHED_TOKENS: cached}
                self.span.set_attributes(attributes)
                self.span.add_event(A.EVENT_FIRST_TOKEN, timestamp=first_ns)
            self.span.end()
