"""Traces and metrics: OpenTelemetry spans across coordinator, prefill, transfer and decode,
Prometheus metrics on every service, and the tools that read them back."""
