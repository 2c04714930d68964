"""The fleet as the playground shows it: every registered worker by model and role, with its
state, load and KV use from the registry, and its caches and speculation from its Stats RPC.

One snapshot is reused for `refresh_s`, and callers arriving while one is being taken wait for
it: any number of open fleet views cost each worker one Stats call per `refresh_s`.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Literal

import grpc

from services.coordinator.route.readiness import fleet_readiness
from services.coordinator.route.registry import WorkerInfo, WorkerRegistry
from shared.proto_gen import worker_pb2 as pb
from shared.proto_gen import worker_pb2_grpc as pb_grpc
from shared.rpc.auth import NO_AUTH, InternalAuth
from shared.rpc.channels import ChannelPool
from shared.wire.records import WorkerLoad

WorkerState = Literal["serving", "draining", "silent", "dead"]

STATS_TIMEOUT_S = 0.5  # a worker slower than this is shown without its stats, not waited on


def worker_state(info: WorkerInfo, now: float, heartbeat_interval_s: float) -> WorkerState:
    """`silent`: alive in the registry but two heartbeats late (stopping, or stuck)."""
    if not info.alive:
        return "dead"
    if info.draining:
        return "draining"
    if now - info.last_seen > 2 * heartbeat_interval_s:
        return "silent"
    return "serving"


class FleetView:
    def __init__(
        self, registry: WorkerRegistry, refresh_s: float = 1.0, auth: InternalAuth = NO_AUTH
    ):
        self.registry = registry
        self.refresh_s = refresh_s
        self._channels = ChannelPool(auth)
        self._snapshot: dict[str, Any] | None = None
        self._taken_at = 0.0
        self._lock = asyncio.Lock()

    async def snapshot(self) -> dict[str, Any]:
        async with self._lock:
            if self._snapshot is None or time.monotonic() - self._taken_at >= self.refresh_s:
                self._snapshot = await self._take()
                self._taken_at = time.monotonic()
            return self._snapshot

    async def _take(self) -> dict[str, Any]:
        registry = self.registry
        workers = list(registry.workers.values())
        stats = await asyncio.gather(*(self._stats(w) if w.alive else _none() for w in workers))
        now = time.monotonic()
        interval = registry.config.coordinator.heartbeat_interval_s
        rows = [
            describe_worker(w, s, worker_state(w, now, interval), now)
            for w, s in zip(workers, stats, strict=True)
        ]
        models = []
        for m in registry.config.models:
            mine = sorted(
                (r for r in rows if r["model"] == m.id), key=lambda r: (r["role"], r["worker_id"])
            )
            models.append(
                {
                    "id": m.id,
                    "expected_workers": m.pools.prefill + m.pools.decode + m.pools.both,
                    "serving_workers": sum(r["state"] == "serving" for r in mine),
                    "workers": mine,
                }
            )
        return {
            "time": time.time(),
            "ready": fleet_readiness(registry)["ready"],
            "heartbeat_interval_s": interval,
            "refresh_s": self.refresh_s,
            "models": models,
        }

    async def _stats(self, worker: WorkerInfo) -> dict[str, Any] | str:
        """The worker's Stats, or why there are none (a string)."""
        stub = pb_grpc.WorkerStub(self._channels.get(worker.address))
        try:
            resp = await stub.Stats(pb.StatsRequest(), timeout=STATS_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            return f"Stats: {exc.code().name}"
        return json.loads(resp.json)

    async def close(self) -> None:
        await self._channels.close()


async def _none() -> str:
    return "dead: not asked"


def describe_worker(
    info: WorkerInfo, stats: dict[str, Any] | str, state: WorkerState, now: float
) -> dict[str, Any]:
    # The load its Stats just gave is fresher than the last heartbeat's (up to an interval old).
    load = WorkerLoad(**stats["load"]) if isinstance(stats, dict) and "load" in stats else info.load
    row: dict[str, Any] = {
        "worker_id": info.worker_id,
        "model": info.model,
        "role": info.role,
        "state": state,
        "address": info.address,
        "last_heartbeat_s_ago": round(now - info.last_seen, 3),
        "in_flight": info.in_flight,
        "load": {
            "running": load.running,
            "waiting": load.waiting,
            "queued_prefill_tokens": load.queued_prefill_tokens,
            "active_kv_tokens": load.active_kv_tokens,
        },
        "kv_cache_usage": _fraction(load.total_blocks - load.free_blocks, load.total_blocks),
        "kv_tiers": {},
        "prefix_cache_hit_rate": None,
        "speculative": None,
        "stats_error": None,
    }
    if isinstance(stats, str):
        row["stats_error"] = stats
        return row
    row["kv_tiers"] = {
        tier: {**t, "usage": _fraction(t["used_blocks"], t["capacity_blocks"])}
        for tier, t in stats.get("kv_tiers", {}).items()
    }
    cache = stats.get("prefix_cache", {})
    hits = sum(cache.get(f"{t}_hit_blocks", 0) for t in ("device", "host", "disk"))
    row["prefix_cache"] = {
        "lookup_blocks": cache.get("lookup_blocks", 0),
        "hit_blocks": hits,
        "host_hit_blocks": cache.get("host_hit_blocks", 0),
        "disk_hit_blocks": cache.get("disk_hit_blocks", 0),
    }
    row["prefix_cache_hit_rate"] = _fraction(hits, cache.get("lookup_blocks", 0))
    spec = stats.get("speculative") or {}
    if spec.get("method", "none") != "none" or spec.get("draft_tokens"):
        row["speculative"] = {
            "method": spec.get("method"),
            "acceptance_rate": spec.get("acceptance_rate"),
            "mean_accepted": spec.get("mean_accepted"),
            "draft_tokens": spec.get("draft_tokens", 0),
        }
    weights = stats.get("weights") or {}
    row["weights"] = {"prefill": weights.get("prefill"), "decode": weights.get("decode")}
    return row


def _fraction(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None
