"""Prometheus metrics for KV transfers, created once per registry.

prometheus_client refuses a second collector with the same name in one registry, and a
process commonly builds several backends (tests, a replica that both sends and receives),
so the collectors are memoised per registry instead of being created by each backend.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from services.kvtransfer.types import TransferHandle, TransferState

# From one 16-token block on loopback to a multi-GiB long-context prefix on TCP.
_SECONDS_BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


@dataclass(frozen=True)
class TransferMetrics:
    transfers: Counter
    bytes: Counter
    seconds: Histogram

    def observe(self, handle: TransferHandle) -> None:
        """Records one finished transfer; bytes and latency only for the ones that completed."""
        labels = {"backend": handle.backend, "role": handle.role}
        self.transfers.labels(state=handle.state.value, **labels).inc()
        if handle.state is TransferState.DONE:
            self.bytes.labels(**labels).inc(handle.nbytes)
            self.seconds.labels(**labels).observe(handle.seconds)


@functools.cache
def _metrics_for(registry: CollectorRegistry) -> TransferMetrics:
    return TransferMetrics(
        transfers=Counter(
            "splitserve_kvtransfer_transfers",
            "KV transfers that reached a terminal state",
            ["backend", "role", "state"],
            registry=registry,
        ),
        bytes=Counter(
            "splitserve_kvtransfer_bytes",
            "KV bytes moved by completed transfers",
            ["backend", "role"],
            registry=registry,
        ),
        seconds=Histogram(
            "splitserve_kvtransfer_seconds",
            "Wall time of completed KV transfers, from send/prepare to done",
            ["backend", "role"],
            buckets=_SECONDS_BUCKETS,
            registry=registry,
        ),
    )


def transfer_metrics(registry: CollectorRegistry | None = None) -> TransferMetrics:
    return _metrics_for(registry if registry is not None else REGISTRY)
