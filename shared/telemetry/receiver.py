"""A small in-process OTLP/gRPC trace receiver: what tests and `bench overhead` point the
services at instead of a real collector. It keeps every span it is sent, as SpanRecords."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as pb_grpc

from shared.telemetry.records import SpanRecord, records_from_otlp


class _TraceService(pb_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver):
        self.receiver = receiver

    def Export(self, request, context):  # noqa: N802 - the gRPC method's name
        self.receiver.add(records_from_otlp(request))
        return pb.ExportTraceServiceResponse()


class OtlpReceiver:
    """`with OtlpReceiver() as r:` then export to `r.endpoint`; `r.wait_for(...)`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self._spans: list[SpanRecord] = []
        self._changed = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        self.endpoint = f"{host}:{self.port}"
        self.requests = 0

    def start(self) -> OtlpReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=0.5).wait(2.0)

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add(self, spans: list[SpanRecord]) -> None:
        with self._changed:
            self._spans.extend(spans)
            self.requests += 1
            self._changed.notify_all()

    @property
    def spans(self) -> list[SpanRecord]:
        with self._changed:
            return list(self._spans)

    def clear(self) -> None:
        with self._changed:
            self._spans.clear()

    def wait_for(
        self, done: Callable[[list[SpanRecord]], bool], timeout_s: float = 10.0
    ) -> list[SpanRecord]:
        """The spans once `done(spans)` holds; raises TimeoutError with what did arrive."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not done(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({f"{s.service}:{s.name}" for s in self._spans})
                    raise TimeoutError(f"spans received so far: {names}")
                self._changed.wait(left)
            return list(self._spans)
