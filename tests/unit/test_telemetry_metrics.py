"""Prometheus metrics: what every service registers, served and parsed as Prometheus would,
and the Grafana dashboard whose every query names a metric that exists."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from services.coordinator.api.metrics import APIMetrics, outcome_of
from services.kvtransfer.metrics import transfer_metrics
from services.worker.engine_metrics import EngineMetrics
from services.worker.metrics_server import serve_metrics
from shared.telemetry.processor import BoundedSpanProcessor, SpanExportCollector

DASHBOARD = Path(__file__).resolve().parents[2] / "helm/splitserve/dashboards/splitserve.json"
_METRIC = re.compile(r"\bsplitserve_[a-z0-9_]+\b")
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}


class _NullExporter:
    def export(self, spans):
        return None

    def shutdown(self):
        pass


@pytest.fixture
def registries(tiny_model):
    engine = Engine(EngineConfig(num_blocks=16), model=tiny_model)
    worker = CollectorRegistry()
    EngineMetrics(worker, engine, "tiny", "decode")
    transfer_metrics(worker)
    processor = BoundedSpanProcessor(_NullExporter())
    worker.register(SpanExportCollector(processor))
    yield {"coordinator": APIMetrics().registry, "worker": worker}
    processor.shutdown()


def sample_names(registry: CollectorRegistry) -> set[str]:
    """Every series name a scrape of `registry` can show (families with no samples too)."""
    text = generate_latest(registry).decode()
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
    return names


def test_every_service_exposes_the_operator_metrics(registries):
    coordinator = sample_names(registries["coordinator"])
    worker = sample_names(registries["worker"])
    for name in (
        "splitserve_time_to_first_token_seconds_bucket",
        "splitserve_inter_token_latency_seconds_bucket",
        "splitserve_e2e_request_latency_seconds_bucket",
        "splitserve_requests_total",
        "splitserve_request_outcomes_total",
        "splitserve_request_migrations_total",
        "splitserve_cached_prompt_tokens_total",
    ):
        assert name in coordinator, name
    for name in (
        "splitserve_request_queue_time_seconds_bucket",
        "splitserve_prefill_tokens_total",
        "splitserve_prefix_cache_hits_total",
        "splitserve_prefix_cache_queries_total",
        "splitserve_iteration_batch_size_bucket",
        "splitserve_kv_cache_blocks_used",
        "splitserve_kv_cache_blocks_free",
        "splitserve_kv_cache_usage_perc",
        "splitserve_num_requests_running",
        "splitserve_engine_aborted_requests_total",
        "splitserve_spec_decode_accepted_tokens_total",
        "splitserve_spec_decode_acceptance_length_bucket",
        "splitserve_kv_push_total",
        "splitserve_kvtransfer_bytes_total",
        "splitserve_kvtransfer_seconds_bucket",
        "splitserve_kvtransfer_transfers_total",
        "splitserve_trace_spans_dropped_total",
    ):
        assert name in worker, name


def test_outcomes_count_fallbacks_and_migrations():
    metrics = APIMetrics()
    metrics.count_outcome("m", "default", 200, {"fallback_attempts": "2", "migrations": "1"})
    metrics.count_outcome("m", "default", 200, {"fallback_attempts": "9"})
    metrics.count_outcome("m", "flex", "stream_error", {})
    text = metrics.render().decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }

    def get(name, **labels):
        return samples.get((name, tuple(sorted(labels.items()))))

    base = {"model": "m", "tier": "default", "outcome": "success"}
    assert get("splitserve_request_outcomes_total", **base, attempt="3") == 1
    assert get("splitserve_request_outcomes_total", **base, attempt="5+") == 1
    assert get("splitserve_request_migrations_total", model="m", tier="default") == 1
    flex = {"model": "m", "tier": "flex", "outcome": "stream_error", "attempt": "1"}
    assert get("splitserve_request_outcomes_total", **flex) == 1
    assert [outcome_of(s) for s in (200, 400, 499, 503, 500)] == [
        "success",
        "client_error",
        "client_closed",
        "unavailable",
        "server_error",
    ]


def test_metrics_server_serves_its_registry_and_the_process_one(registries):
    server = serve_metrics(registries["worker"], "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://{server.address}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        server.close()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert "splitserve_kv_cache_blocks_total" in names
    assert "process_cpu_seconds" in names or "python_info" in names  # the default registry
    assert server.port > 0


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        if panel["type"] != "row"
        for target in panel["targets"]
    ]


def test_dashboard_is_a_valid_grafana_dashboard():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 30
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "model"} <= variables
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs))
    for title, expr in _queries(dashboard):
        assert expr.count("(") == expr.count(")"), title
        assert expr.count("{") == expr.count("}"), title


def test_every_dashboard_query_names_a_registered_metric(registries):
    known = sample_names(registries["coordinator"]) | sample_names(registries["worker"])
    dashboard = json.loads(DASHBOARD.read_text())
    unknown = {
        (title, name) for title, expr in _queries(dashboard) for name in _METRIC.findall(expr)
    }
    unknown = {(title, name) for title, name in unknown if name not in known}
    assert not unknown, f"queries name metrics nobody registers: {sorted(unknown)}"
    text = DASHBOARD.read_text()
    for topic in (
        "time_to_first_token",  # latency percentiles per tier
        "prefix_cache_hits",  # cache hit rate
        "kvtransfer_bytes",  # transfer
        "kv_cache_usage_perc",  # pool utilisation
        "request_outcomes",  # errors
    ):
        assert topic in text, topic


def test_attempts_and_migrations_given_as_json_lists():
    metrics = APIMetrics()
    attempts = '[{"model": "a", "success": false}, {"model": "b", "success": true}]'
    metrics.count_outcome("m", "default", 200, {"attempts": attempts, "migrations": "[{}, {}]"})
    text = metrics.render().decode()
    outcome = 'attempt="2",model="m",outcome="success",tier="default"'
    assert f"splitserve_request_outcomes_total{{{outcome}}} 1.0" in text
    assert 'splitserve_request_migrations_total{model="m",tier="default"} 2.0' in text


@pytest.mark.parametrize(
    ("reasons", "attempt", "migrations"),
    [
        (["first", "fallback", "migration"], 2, 1),  # one fallback, one migration
        (["first", "drain", "migration"], 1, 2),  # a drain's hand-over is a migration
    ],
)
def test_attempts_count_fallbacks_and_migrations_by_their_reason(reasons, attempt, migrations):
    metrics = APIMetrics()
    attempts = [{"reason": r} for r in reasons]
    metrics.count_outcome("m", "default", 200, {"attempts": json.dumps(attempts)})
    text = metrics.render().decode()
    outcome = f'attempt="{attempt}",model="m",outcome="success",tier="default"'
    assert f"splitserve_request_outcomes_total{{{outcome}}} 1.0" in text
    assert f'splitserve_request_migrations_total{{model="m",tier="default"}} {migrations}.0' in text
