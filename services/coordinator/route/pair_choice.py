"""Choosing the replicas for one request: the registry's view handed to the router pipeline
(services/router), and its answer mapped back to registry entries."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from services.coordinator.route.registry import WorkerInfo, WorkerRegistry
from services.router.pipeline import RouteRequest
from services.router.replica import ReplicaState


@dataclass
class RoutingDecision:
    prefill: WorkerInfo | None  # None: the decode replica prefills locally (colocated)
    decode: WorkerInfo
    reasoning: list[str] = field(default_factory=list)

    def describe(self) -> str:
        if self.prefill is None:
            return self.decode.worker_id
        return f"{self.prefill.worker_id}->{self.decode.worker_id}"


def replica_state(w: WorkerInfo, excluded: bool = False) -> ReplicaState:
    return ReplicaState(
        worker_id=w.worker_id,
        role=w.role,  # type: ignore[arg-type]  # checked at registration
        model=w.model,
        alive=w.routable and not excluded,
        in_flight=w.in_flight,
        load=w.load,
    )


def _salt(registry: WorkerRegistry, model: str) -> bytes:
    """The workers salt block hashes with their tokenizer fingerprint; use what they reported
    (the configured one when none has registered yet)."""
    reported = sorted(
        w.tokenizer_fingerprint
        for w in registry.workers.values()
        if w.model == model and w.tokenizer_fingerprint
    )
    fingerprint = reported[0] if reported else registry.fingerprints.get(model, "")
    return fingerprint.encode()


def choose_pair(
    registry: WorkerRegistry,
    model: str,
    *,
    prompt_token_ids: Sequence[int] | None = None,
    previous_decode: str | None = None,
    exclude: Collection[str] = frozenset(),
) -> RoutingDecision | None:
    """`previous_decode`: the worker that served this conversation's previous turn, if known;
    `exclude`: workers that already failed this request."""
    replicas = [replica_state(w, w.worker_id in exclude) for w in registry.workers.values()]
    request = RouteRequest(model, prompt_token_ids, previous_decode)
    route = registry.router.route(replicas, registry.kv, request, _salt(registry, model))
    if route is None:
        return None
    prefill = registry.workers[route.prefill] if route.prefill is not None else None
    reasoning = list(route.reasoning)
    if exclude:
        reasoning.insert(0, f"excluded after failing this request: {', '.join(sorted(exclude))}")
    return RoutingDecision(prefill, registry.workers[route.decode], reasoning)
