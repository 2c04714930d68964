"""Everything a worker process observes itself with: its tracer, its Prometheus registry
(served over HTTP on a port the kernel picks), the engine's step metrics and the request
timelines its spans are built from."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from engine.core.engine import Engine
from services.worker.engine_metrics import EngineMetrics
from services.worker.engine_steps import StepRecorder
from services.worker.metrics_server import MetricsServer, serve_metrics
from services.worker.spans import WorkerTracing
from shared.config.schema import DeploymentConfig
from shared.telemetry.tracing import Tracing


@dataclass
class WorkerTelemetry:
    tracing: Tracing
    registry: CollectorRegistry
    metrics: EngineMetrics
    spans: WorkerTracing
    server: MetricsServer | None = None

    @classmethod
    def create(
        cls,
        config: DeploymentConfig,
        engine: Engine,
        *,
        worker_id: str,
        role: str,
        model: str,
        serve_http: bool = True,
    ) -> WorkerTelemetry:
        """Attach to `engine` (before its thread starts) and, by default, serve /metrics."""
        tracing = Tracing.from_config(config.telemetry, f"splitserve-{role}", worker_id)
        registry = CollectorRegistry()
        metrics = EngineMetrics(registry, engine, model, role)
        tracing.register_metrics(registry)
        recorder = StepRecorder(metrics)
        engine.step_observers.append(recorder)
        spans = WorkerTracing(tracing, recorder, replica=worker_id, role=role, model=model)
        port = config.telemetry.worker_metrics_port
        server = serve_metrics(registry, config.worker_host, port) if serve_http else None
        return cls(tracing, registry, metrics, spans, server)

    @property
    def metrics_address(self) -> str:
        return self.server.address if self.server is not None else ""

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.tracing.shutdown()
