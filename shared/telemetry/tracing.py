"""A process's tracer, built once from the deployment's `telemetry:` section.

Each service makes its own `Tracing` and hands it to what creates spans (no global tracer
provider: several services can share one process in tests). `Tracing.disabled()` is the
no-op default, costing nothing per request.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry import trace

from shared.config.schema import TelemetryConfig

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from prometheus_client import CollectorRegistry

    from shared.telemetry.processor import BoundedSpanProcessor
    from shared.telemetry.recent_traces import RecentTraces

# The OpenTelemetry SDK (and the exporters) are imported only by a process that traces: with
# tracing off (the default) the API's no-op tracer is all a service needs, and the SDK's
# import (resources, psutil, the span processor) is a visible share of start-up time.

DEFAULT_OTLP_GRPC_ENDPOINT = "localhost:4317"
DEFAULT_OTLP_HTTP_ENDPOINT = "http://localhost:4318/v1/traces"
INSTRUMENTATION_NAME = "splitserve"


@dataclass
class Tracing:
    tracer: trace.Tracer
    capture_content: bool = False
    provider: TracerProvider | None = None
    processor: BoundedSpanProcessor | None = None
    recent: RecentTraces | None = None  # the last finished traces, kept in memory

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    @classmethod
    def disabled(cls) -> Tracing:
        return cls(trace.NoOpTracer())

    @classmethod
    def from_config(
        cls,
        config: TelemetryConfig,
        service: str,
        instance: str | None = None,
        recent_traces: int = 0,
    ) -> Tracing:
        """`recent_traces` > 0 also keeps that many finished traces in memory."""
        if config.exporter == "none":
            return cls.disabled()
        return cls.with_exporter(
            create_exporter(config),
            service,
            instance,
            sampling_ratio=config.sampling_ratio,
            capture_content=config.capture_content,
            max_queue_size=config.export_queue_size,
            recent_traces=recent_traces,
        )

    @classmethod
    def with_exporter(
        cls,
        exporter: SpanExporter,
        service: str,
        instance: str | None = None,
        *,
        sampling_ratio: float = 1.0,
        capture_content: bool = False,
        max_queue_size: int = 2048,
        recent_traces: int = 0,
    ) -> Tracing:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.sampling import AlwaysRecordSampler, ParentBasedTraceIdRatio

        from shared.telemetry.processor import BoundedSpanProcessor

        attributes = {"service.name": service, "process.pid": os.getpid()}
        if instance:
            attributes["service.instance.id"] = instance
        # Unsampled spans are still recorded (not exported) so that one ending in error can
        # be kept by the processor; sampled parents decide for their remote children.
        sampler = AlwaysRecordSampler(ParentBasedTraceIdRatio(sampling_ratio))
        provider = TracerProvider(
            sampler=sampler, resource=Resource(attributes), shutdown_on_exit=False
        )
        processor = BoundedSpanProcessor(exporter, max_queue_size=max_queue_size)
        provider.add_span_processor(processor)
        recent = None
        if recent_traces:
            from shared.telemetry.recent_traces import RecentTraces

            # Sampled or not: the playground shows the trace of the turn just made.
            recent = RecentTraces(recent_traces)
            provider.add_span_processor(recent)
        tracer = provider.get_tracer(INSTRUMENTATION_NAME)
        return cls(tracer, capture_content, provider, processor, recent)

    def register_metrics(self, registry: CollectorRegistry) -> None:
        """Expose the span export counters (drops included) on `registry`."""
        if self.processor is not None:
            from shared.telemetry.processor import SpanExportCollector

            registry.register(SpanExportCollector(self.processor))

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        if self.processor is None:
            return True
        return self.processor.force_flush(int(timeout_s * 1000))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        if self.processor is not None:
            self.processor.shutdown(timeout_s)


def create_exporter(config: TelemetryConfig) -> SpanExporter:
    # Each exporter is imported only when chosen (see the SDK note at the top).
    if config.exporter == "file":
        from shared.telemetry.file_export import JsonLinesSpanExporter

        return JsonLinesSpanExporter(config.file)
    if config.exporter == "otlp_grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        from shared.telemetry.reconnect import OTLP_GRPC_CHANNEL_OPTIONS, ReconnectingSpanExporter

        endpoint = config.endpoint or DEFAULT_OTLP_GRPC_ENDPOINT
        return ReconnectingSpanExporter(
            lambda: OTLPSpanExporter(
                endpoint=endpoint,
                insecure=not endpoint.startswith("https://"),
                timeout=config.export_timeout_s,
                channel_options=OTLP_GRPC_CHANNEL_OPTIONS,
            )
        )
    if config.exporter == "otlp_http":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as OTLPHttpSpanExporter,
        )

        return OTLPHttpSpanExporter(
            endpoint=config.endpoint or DEFAULT_OTLP_HTTP_ENDPOINT, timeout=config.export_timeout_s
        )
    raise ValueError(f"unknown trace exporter {config.exporter!r}")  # the schema refused it
