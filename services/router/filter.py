"""Filter: the replicas that may take a request at all (alive, right model and role), then
those with room for it. When every eligible replica is over a limit the limits are waived
(and said so): queueing somewhere beats refusing, and admission control is not routing's job.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from services.router.replica import ReplicaState
from shared.config.roles import WorkerRole
from shared.config.router import RouterConfig


@dataclass(frozen=True)
class Filtered:
    kept: list[ReplicaState]
    notes: list[str] = field(default_factory=list)


def eligible(replicas: Iterable[ReplicaState], model: str, roles: Sequence[WorkerRole]) -> list:
    return [r for r in replicas if r.alive and r.model == model and r.role in roles]


def over_capacity(r: ReplicaState, cfg: RouterConfig, need_blocks: int) -> str | None:
    """Why this replica has no room for a request needing `need_blocks` KV blocks, or None."""
    load = r.load
    if cfg.max_waiting is not None and load.waiting > cfg.max_waiting:
        return f"{load.waiting} waiting > {cfg.max_waiting}"
    if (
        r.can_prefill
        and cfg.max_queued_prefill_tokens is not None
        and load.queued_prefill_tokens > cfg.max_queued_prefill_tokens
    ):
        queued = load.queued_prefill_tokens
        return f"{queued} queued prefill tokens > {cfg.max_queued_prefill_tokens}"
    if r.can_decode and load.total_blocks > 0 and load.free_blocks < need_blocks:
        return f"{load.free_blocks} free KV blocks < {need_blocks} needed"
    return None


def filter_replicas(
    replicas: Iterable[ReplicaState],
    model: str,
    roles: Sequence[WorkerRole],
    cfg: RouterConfig,
    need_blocks: int = 0,
) -> Filtered:
    candidates = sorted(eligible(replicas, model, roles), key=lambda r: r.worker_id)
    kept, notes = [], []
    for r in candidates:
        why = over_capacity(r, cfg, need_blocks)
        if why is None:
            kept.append(r)
        else:
            notes.append(f"{r.worker_id} skipped: {why}")
    if candidates and not kept:
        return Filtered(candidates, [*notes, "every candidate is over a limit: limits waived"])
    return Filtered(kept, notes)
