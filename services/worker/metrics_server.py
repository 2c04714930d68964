"""A worker's `/metrics` over HTTP on a port the kernel picks (several workers share a host);
the worker reports the address when it registers, and the coordinator lists it on /ready."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from threading import Thread
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector


class ForwardCollector(Collector):
    """Everything in another registry; here, the process-wide one that libraries write to
    (the KV-transfer metrics, process CPU and memory)."""

    def __init__(self, source: CollectorRegistry):
        self.source = source

    def collect(self) -> Iterator[Metric]:
        yield from self.source.collect()


@dataclass
class MetricsServer:
    server: WSGIServer
    thread: Thread
    host: str

    @property
    def port(self) -> int:
        return self.server.server_port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5.0)


def serve_metrics(
    registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0, *, include_default=True
) -> MetricsServer:
    """Serve `registry` (plus the process-wide default registry) on http://host:port/metrics."""
    if include_default and registry is not REGISTRY:
        registry.register(ForwardCollector(REGISTRY))
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(server, thread, host)
