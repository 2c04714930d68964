"""A worker's Prometheus metrics: the engine's steps, queues, KV pool and prefix cache.

Names follow what vLLM and Dynamo operators already read (queue time, iteration tokens,
KV cache usage, prefix cache queries/hits, spec-decode acceptance), under `splitserve_`.
Step metrics are fed on the engine thread after each step; pool and cache figures are read
when Prometheus scrapes, from counters the engine keeps anyway (a scrape may see them one
step stale, which is fine for a gauge).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.core.engine import Engine
from engine.core.scheduler import StepBatch
from services.worker.engine_steps import is_prefill_step

# Scheduling priority (Generation.priority) -> the OpenAI service tier it came from.
PRIORITY_TIERS = {0: "priority", 1: "default", 2: "flex", 3: "batch"}

_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_ACCEPT_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16)


class EngineMetrics:
    """Step metrics of one engine; call it as the StepRecorder's metrics sink."""

    def __init__(self, registry: CollectorRegistry, engine: Engine, model: str, role: str):
        self.labels = (model, role)
        names = ("model", "role")
        self.queue_time = Histogram(
            "splitserve_request_queue_time_seconds",
            "Time a request waited in the engine before its first step, per service tier",
            (*names, "tier"),
            buckets=_QUEUE_BUCKETS,
            registry=registry,
        )
        self.prefill_tokens = Counter(
            "splitserve_prefill_tokens",
            "Prompt tokens by source: computed by this engine, or reused from its prefix cache",
            (*names, "source"),
            registry=registry,
        )
        self.batch_size = Histogram(
            "splitserve_iteration_batch_size",
            "Sequences per engine step",
            names,
            buckets=_BATCH_BUCKETS,
            registry=registry,
        )
        self.iteration_tokens = Histogram(
            "splitserve_iteration_tokens",
            "Tokens computed per engine step (prefill chunks and decodes together)",
            names,
            buckets=_TOKEN_BUCKETS,
            registry=registry,
        )
        self.step_seconds = Histogram(
            "splitserve_engine_step_seconds",
            "Wall time of one engine step (schedule, forward, sample)",
            names,
            buckets=_STEP_BUCKETS,
            registry=registry,
        )
        self.preemptions = Counter(
            "splitserve_num_preemptions",
            "Sequences preempted for lack of KV blocks",
            names,
            registry=registry,
        )
        self.spec_draft_tokens = Counter(
            "splitserve_spec_decode_draft_tokens",
            "Draft tokens proposed by speculative decoding",
            names,
            registry=registry,
        )
        self.spec_accepted_tokens = Counter(
            "splitserve_spec_decode_accepted_tokens",
            "Draft tokens the target model accepted",
            names,
            registry=registry,
        )
        self.spec_acceptance_length = Histogram(
            "splitserve_spec_decode_acceptance_length",
            "Draft tokens accepted per verification step",
            names,
            buckets=_ACCEPT_BUCKETS,
            registry=registry,
        )
        self.spec_draft_info = Gauge(
            "splitserve_spec_decode_draft_info",
            "1 for the draft version this engine drafts with (a hot swap moves the label)",
            (*names, "version"),
            registry=registry,
        )
        self._draft_version: str | None = None
        self.kv_pushes = Counter(
            "splitserve_kv_push",
            "KV pushes from this prefill replica by backend and outcome (done, failed, ...)",
            (*names, "backend", "status"),
            registry=registry,
        )
        self.engine = engine
        registry.register(EngineStateCollector(engine, model, role))

    def __call__(self, batch: StepBatch, start_ns: int, end_ns: int) -> None:
        labels = self.labels
        for draft_tokens, accepted in self.engine.speculator.stats.drain():
            self.observe_speculation(draft_tokens, accepted)
        version = self.engine.speculator.stats.draft_version
        if version != self._draft_version:
            if self._draft_version is not None:
                self.spec_draft_info.remove(*labels, self._draft_version)
            if version is not None:
                self.spec_draft_info.labels(*labels, version).set(1)
            self._draft_version = version
        self.batch_size.labels(*labels).observe(len(batch.scheduled))
        self.iteration_tokens.labels(*labels).observe(batch.num_batched_tokens)
        self.step_seconds.labels(*labels).observe((end_ns - start_ns) / 1e9)
        if batch.preempted:
            self.preemptions.labels(*labels).inc(len(batch.preempted))
        step_start = time.monotonic() - (end_ns - start_ns) / 1e9
        computed = 0
        for item in batch.scheduled:
            seq = item.seq
            if not is_prefill_step(seq, item.num_tokens):
                continue
            computed += item.num_tokens
            before = seq.num_computed_tokens - item.num_tokens
            if before == seq.num_cached_prompt_tokens and seq.num_preemptions == 0:
                # Its first chunk: the wait ends here, and the cache hit is known.
                tier = PRIORITY_TIERS.get(seq.priority, str(seq.priority))
                wait = max(0.0, step_start - seq.arrival_time)
                self.queue_time.labels(*labels, tier).observe(wait)
                if seq.num_cached_prompt_tokens:
                    cached = seq.num_cached_prompt_tokens
                    self.prefill_tokens.labels(*labels, "cached").inc(cached)
        if computed:
            self.prefill_tokens.labels(*labels, "computed").inc(computed)

    def observe_speculation(self, draft_tokens: int, accepted_tokens: int) -> None:
        """One verification step of speculative decoding (fed by the decoding loop)."""
        self.spec_draft_tokens.labels(*self.labels).inc(draft_tokens)
        self.spec_accepted_tokens.labels(*self.labels).inc(accepted_tokens)
        self.spec_acceptance_length.labels(*self.labels).observe(accepted_tokens)

    def observe_push(self, backend: str, status: str) -> None:
        self.kv_pushes.labels(*self.labels, backend or "none", status or "unknown").inc()


class EngineStateCollector(Collector):
    """Queue lengths, KV pool occupancy and prefix-cache hits, read at scrape time."""

    def __init__(self, engine: Engine, model: str, role: str):
        self.engine = engine
        self.label_values = [model, role]

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        names, values = ["model", "role"], self.label_values
        sched, blocks = self.engine.scheduler, self.engine.blocks
        total = blocks.num_blocks
        available = blocks.num_available_blocks
        used = total - available
        gauges = (
            ("num_requests_running", "Sequences in the running batch", len(sched.running)),
            ("num_requests_waiting", "Sequences waiting to start or resume", len(sched.waiting)),
            ("kv_cache_blocks_total", "KV blocks in the device pool", total),
            ("kv_cache_blocks_used", "KV blocks held by live sequences", used),
            ("kv_cache_blocks_free", "KV blocks free or reclaimable from the cache", available),
            (
                "kv_cache_usage_perc",
                "Fraction of KV blocks held (0-1)",
                used / total if total else 0,
            ),
        )
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(f"splitserve_{name}", doc, labels=names)
            gauge.add_metric(values, value)
            yield gauge
        stats = blocks.stats
        queries = CounterMetricFamily(
            "splitserve_prefix_cache_queries",
            "Prompt blocks looked up in the prefix cache",
            labels=names,
        )
        queries.add_metric(values, stats.lookup_blocks)
        yield queries
        hits = CounterMetricFamily(
            "splitserve_prefix_cache_hits",
            "Prompt blocks reused from the prefix cache, by the tier they were found in",
            labels=[*names, "tier"],
        )
        hits.add_metric([*values, "device"], stats.device_hit_blocks)
        hits.add_metric([*values, "host"], stats.host_hit_blocks)
        hits.add_metric([*values, "disk"], stats.disk_hit_blocks)
        yield hits
        aborted = CounterMetricFamily(
            "splitserve_engine_aborted_requests",
            "Requests stopped before they finished (client gone, migrated, stop string)",
            labels=names,
        )
        aborted.add_metric(values, self.engine.num_aborted)
        yield aborted
        yield from self._weights(names, values)
        yield from self._experts(names, values)

    def _experts(self, names: list[str], values: list[str]) -> Iterator[CounterMetricFamily]:
        """Tokens routed to each expert of each sparse layer: a skewed row is an expert that
        bounds the step (and what expert-parallel placement would balance)."""
        load = self.engine.model.expert_load()
        if not load:
            return
        routed = CounterMetricFamily(
            "splitserve_moe_expert_tokens",
            "Tokens routed to each expert of each sparse MLP layer",
            labels=[*names, "layer", "expert"],
        )
        for layer, counts in load.items():
            for expert, count in enumerate(counts):
                routed.add_metric([*values, str(layer), str(expert)], count)
        yield routed

    def _weights(self, names: list[str], values: list[str]) -> Iterator[GaugeMetricFamily]:
        """The formats each path computes in (and the timings `auto` chose them by), and the
        memory the weights and the KV pool hold."""
        report = self.engine.weights_report()
        info = GaugeMetricFamily(
            "splitserve_weights_info",
            "Weight format of each path (prefill, decode); the value is always 1",
            labels=[*names, "path", "format"],
        )
        for path in ("prefill", "decode"):
            info.add_metric([*values, path, report[path]], 1)
        yield info
        memory = GaugeMetricFamily(
            "splitserve_model_memory_bytes",
            "Bytes held by each weight representation and by the KV pool",
            labels=[*names, "part"],
        )
        for part, nbytes in report["memory_bytes"].items():
            memory.add_metric([*values, part], nbytes)
        yield memory
        choice = report.get("choice")
        if choice:
            timing = GaugeMetricFamily(
                "splitserve_weight_format_measured_ms",
                "What `weights: auto` measured per eligible format on this machine",
                labels=[*names, "format", "measure"],
            )
            for fmt, figures in choice["timings"].items():
                for measure, ms in figures.items():
                    timing.add_metric([*values, fmt, measure], ms)
            yield timing
