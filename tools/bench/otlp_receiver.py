"""A small in-process OTLP/gRPC trace receiver: what tests and `bench overhead` point the
services at instead of a real collector. It keeps every span it is sent, as SpanRecords."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

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
    """Export to `r.endpoint`; `r.start()`; `r.wait_for(...)`.

    The port is chosen at construction but the gRPC server only exists between `start()`
    and `stop()`: start it *after* launching child processes, because a process that
    forks while gRPC's threads run can crash the child before it execs. `stop()` then
    `start()` again plays a collector that went away and came back.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host = host
        self.port = port or _free_port(host)
        self.endpoint = f"{host}:{self.port}"
        self._spans: list[SpanRecord] = []
        self._changed = threading.Condition()
        self._server: grpc.Server | None = None
        self.requests = 0

    def start(self) -> OtlpReceiver:
        if self._server is not None:
            return self
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_TraceServiceServicer_to_server(_TraceService(self), server)
        if server.add_insecure_port(self.endpoint) != self.port:
            raise OSError(f"cannot listen on {self.endpoint} (taken since it was chosen?)")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=0.5).wait(2.0)
            self._server = None

    def __enter__(self) -> OtlpReceiver:
        return self

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


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ReceiverProcess:
    """An OtlpReceiver in its own process: a collector that takes no CPU time or GIL from the
    process measuring latency (benchmarks). Reports only how many spans it received.

    A fresh interpreter (`python -m tools.bench.otlp_receiver PORT`), driven over its stdin
    and stdout one line at a time: it prints "ready", answers "count" with a number, and
    exits on "stop" or end of input.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host = host
        self.port = port or _free_port(host)
        self.endpoint = f"{host}:{self.port}"
        self._process: subprocess.Popen[str] | None = None

    def start(self) -> ReceiverProcess:
        root = str(Path(__file__).resolve().parents[2])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        }
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tools.bench.otlp_receiver", self.host, str(self.port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        if self._ask(None) != "ready":
            raise RuntimeError(f"the OTLP receiver process did not start on {self.endpoint}")
        return self

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def span_count(self) -> int:
        return int(self._ask("count"))

    def _ask(self, command: str | None) -> str:
        assert self._process is not None and self._process.stdin and self._process.stdout
        if command is not None:
            self._process.stdin.write(command + "\n")
            self._process.stdin.flush()
        return self._process.stdout.readline().strip()

    def stop(self) -> None:
        if self._process is None:
            return
        with contextlib.suppress(OSError, ValueError):
            self._process.stdin.close()  # type: ignore[union-attr]
        try:
            self._process.wait(5.0)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None

    def __enter__(self) -> ReceiverProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _serve(host: str, port: int) -> None:
    receiver = OtlpReceiver(host, port).start()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "count":
            print(len(receiver.spans), flush=True)
        elif line.strip() == "stop":
            break
    receiver.stop()


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))
