"""One finished span as plain data: what the JSON-lines file holds, what the in-process OTLP
receiver collects, and what `splitserve trace` draws. The same shape from every source."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.sdk.trace import ReadableSpan

# OTLP enum numbers (opentelemetry/proto/trace/v1/trace.proto) to the SDK's names.
_OTLP_KINDS = {0: "INTERNAL", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
_OTLP_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


@dataclass
class EventRecord:
    name: str
    time_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass
class SpanRecord:
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str | None
    name: str
    kind: str
    service: str  # the resource's service.name: which process made it
    start_ns: int
    end_ns: int
    status: str = "UNSET"  # UNSET | OK | ERROR
    status_message: str = ""
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[EventRecord] = field(default_factory=list)
    resource: dict[str, Any] = field(default_factory=dict)

    @property
    def is_error(self) -> bool:
        return self.status == "ERROR"

    def to_json(self) -> dict[str, Any]:
        return {
            "trace_id": self.trace_id,
            "span_id": self.span_id,
            "parent_span_id": self.parent_span_id,
            "name": self.name,
            "kind": self.kind,
            "service": self.service,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "status": self.status,
            "status_message": self.status_message,
            "attributes": self.attributes,
            "events": [
                {"name": e.name, "time_ns": e.time_ns, "attributes": e.attributes}
                for e in self.events
            ],
            "resource": self.resource,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SpanRecord:
        events = [EventRecord(**e) for e in data.get("events", [])]
        return cls(**{**data, "events": events})

    @classmethod
    def from_readable(cls, span: ReadableSpan) -> SpanRecord:
        ctx = span.context
        resource = dict(span.resource.attributes) if span.resource else {}
        return cls(
            trace_id=f"{ctx.trace_id:032x}",
            span_id=f"{ctx.span_id:016x}",
            parent_span_id=f"{span.parent.span_id:016x}" if span.parent else None,
            name=span.name,
            kind=span.kind.name,
            service=str(resource.get("service.name", "")),
            start_ns=span.start_time or 0,
            end_ns=span.end_time or span.start_time or 0,
            status=span.status.status_code.name,
            status_message=span.status.description or "",
            attributes=_plain(span.attributes),
            events=[EventRecord(e.name, e.timestamp, _plain(e.attributes)) for e in span.events],
            resource=_plain(resource),
        )


def records_from_otlp(request: ExportTraceServiceRequest) -> list[SpanRecord]:
    out = []
    for rs in request.resource_spans:
        resource = _otlp_attributes(rs.resource.attributes)
        service = str(resource.get("service.name", ""))
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    SpanRecord(
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex() or None,
                        name=s.name,
                        kind=_OTLP_KINDS.get(s.kind, "INTERNAL"),
                        service=service,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        status=_OTLP_STATUS.get(s.status.code, "UNSET"),
                        status_message=s.status.message,
                        attributes=_otlp_attributes(s.attributes),
                        events=[
                            EventRecord(e.name, e.time_unix_nano, _otlp_attributes(e.attributes))
                            for e in s.events
                        ],
                        resource=resource,
                    )
                )
    return out


def _plain(attributes) -> dict[str, Any]:
    if not attributes:
        return {}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in attributes.items()}


def _otlp_attributes(items: list[KeyValue]) -> dict[str, Any]:
    return {kv.key: _otlp_value(kv.value) for kv in items}


def _otlp_value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_otlp_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return _otlp_attributes(value.kvlist_value.values)
    return getattr(value, which) if which else None
