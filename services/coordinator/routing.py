"""Choosing the replicas for one request. For now least-loaded prefill and least-loaded
decode; the KV-aware scorer replaces `choose_pair`'s scoring in the router issue."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.coordinator.registry import WorkerInfo, WorkerRegistry


@dataclass
class RoutingDecision:
    prefill: WorkerInfo | None  # None: the decode replica prefills locally (colocated)
    decode: WorkerInfo
    reasoning: list[str] = field(default_factory=list)

    def describe(self) -> str:
        if self.prefill is None:
            return self.decode.worker_id
        return f"{self.prefill.worker_id}->{self.decode.worker_id}"


def prefill_load(w: WorkerInfo) -> tuple[int, int]:
    return (w.in_flight, w.load.queued_prefill_tokens)


def decode_load(w: WorkerInfo) -> tuple[int, int]:
    return (w.in_flight + w.load.running, w.load.active_kv_tokens)


def choose_pair(registry: WorkerRegistry, model: str) -> RoutingDecision | None:
    alive = registry.alive(model)
    prefills = [w for w in alive if w.role == "prefill"]
    decodes = [w for w in alive if w.role == "decode"]
    if prefills and decodes:
        p = min(prefills, key=prefill_load)
        d = min(decodes, key=decode_load)
        return RoutingDecision(
            p,
            d,
            [
                f"disaggregated: least-loaded prefill {p.worker_id} (in_flight={p.in_flight}, "
                f"queued_prefill_tokens={p.load.queued_prefill_tokens})",
                f"least-loaded decode {d.worker_id} "
                f"(in_flight={d.in_flight}, running={d.load.running})",
            ],
        )
    both = [w for w in alive if w.role == "both"]
    if both:
        b = min(both, key=decode_load)
        return RoutingDecision(None, b, [f"colocated: least-loaded replica {b.worker_id}"])
    return None
