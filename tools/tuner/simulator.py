"""Replaying a trace through a simulated fleet: P prefill and D decode replicas, a router,
chunked prefill, KV transfer, continuous-batching decode, tiers.

Arrivals drive the loop. Before each one is routed, every replica is brought up to its
arrival time (lazily: a replica with nothing due returns at once), so the router sees the
loads the coordinator would; the request's prefill and decode replicas are both chosen then,
as the coordinator does: first the conditional-disaggregation check (the decode replica
holding the longest prefix of the prompt prefills a short uncached tail itself, by the live
router's rule), else a prefill replica by the policy and the least-loaded decode replica.
Prefill replicas hand finished prompts to decode replicas, never the other way, so bringing
prefills up to a time before decodes keeps causality. After the last arrival everything is
drained.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

from services.planner.replica_profile import ReplicaProfile
from services.router.disagg import disaggregate_because
from services.router.index import PrefixHit
from services.router.score import cached_tokens
from shared.config.router import RouterConfig
from tools.tuner.decode_sim import DecodeReplica
from tools.tuner.fleet import FleetConfig, assign_priorities
from tools.tuner.prefill_sim import PrefillReplica
from tools.tuner.prefix_cache import PrefixCache
from tools.tuner.requests import RequestTable
from tools.tuner.results import SimResult
from tools.tuner.routing import SimulatedRouter, choose_decode
from tools.tuner.trace import Trace

ProgressFn = Callable[[int, int], None]
PROGRESS_EVERY = 8192


def _cache_blocks(fleet: FleetConfig, profile: ReplicaProfile, trace: Trace) -> int | None:
    if fleet.unbounded_cache:
        return None
    tokens = profile.kv_capacity_tokens if fleet.cache_tokens is None else fleet.cache_tokens
    return int(tokens // max(trace.block_tokens, 1e-9))


def _host_blocks(fleet: FleetConfig, trace: Trace) -> int:
    return (
        0
        if fleet.unbounded_cache
        else int(fleet.host_cache_tokens // max(trace.block_tokens, 1e-9))
    )


def _decode_cache_blocks(fleet: FleetConfig, profile: ReplicaProfile, trace: Trace) -> int | None:
    """A decode replica's pool keeps finished sequences' blocks cached, as much as it holds."""
    if fleet.unbounded_cache or fleet.unbounded_decode_kv:
        return None
    return int(profile.kv_capacity_tokens // max(trace.block_tokens, 1e-9))


def _prefilled_locally(
    rid: int,
    now: float,
    decodes: list[DecodeReplica],
    table: RequestTable,
    cfg: RouterConfig,
    profile: ReplicaProfile,
) -> bool:
    """Conditional disaggregation: the decode replica holding the longest prefix of the
    prompt (the lowest index on a tie, as the live router's replica ids sort) prefills the
    tail itself when the live router's rule says so. Routes the request there if it does."""
    ids = table.hash_ids[rid]
    if not ids:
        return False
    best, held = 0, -1
    for d, replica in enumerate(decodes):
        n = replica.cache.match(ids)
        if n > held:
            best, held = d, n
    prompt = table.input[rid]
    cached = cached_tokens(PrefixHit(device=held), table.block_tokens, prompt).total
    if disaggregate_because(cached, prompt, cfg) is not None:
        return False
    target = decodes[best]
    table.hit[rid] = table.cached[rid] = cached
    table.decode_replica[rid] = best
    target.assigned += 1
    target.cache.insert(ids)
    target.local_join(rid, now, profile.prefill_ms(prompt, cached))
    return True


def simulate(
    trace: Trace,
    profile: ReplicaProfile,
    fleet: FleetConfig,
    priorities: np.ndarray | None = None,
    progress: ProgressFn | None = None,
    router_config: RouterConfig | None = None,
) -> SimResult:
    """`router_config`: the live router's weights (host-hit cost, queue weight); its policy is
    overridden by `fleet.router`."""
    started = time.perf_counter()
    n = len(trace)
    if priorities is None:
        priorities = assign_priorities(n, None)
    table = RequestTable(trace, priorities)
    chunk = fleet.chunk_tokens or profile.chunk_tokens
    decode_kv = None if fleet.unbounded_decode_kv else profile.kv_capacity_tokens
    router_cfg = router_config or RouterConfig()
    blocks = _cache_blocks(fleet, profile, trace)
    # What a decode replica holds is only looked at for conditional disaggregation.
    local_prefill = trace.hash_ids is not None and router_cfg.local_prefill_max_tokens > 0
    decodes = [
        DecodeReplica(
            i,
            profile.decode,
            fleet.decode_max_batch,
            table,
            decode_kv,
            # A preempted sequence's KV is recomputed as a prompt of its context on this
            # hardware (the engine's `recompute` preemption mode).
            profile.prefill_ms,
            PrefixCache(_decode_cache_blocks(fleet, profile, trace)) if local_prefill else None,
        )
        for i in range(fleet.decode_replicas)
    ]
    handoff = fleet.handoff_ms

    def on_prefilled(rid: int, first_token: float, kv_ready: float) -> None:
        table.ttft[rid] = first_token
        decode = decodes[table.decode_replica[rid]]
        if table.output[rid] <= 1:  # the prefill replica's token was the whole reply
            table.finish[rid] = first_token
            decode.assigned -= 1
        else:
            # The coordinator opens the decode stream on the first token; the decode replica
            # steps the sequence once its KV has landed too.
            decode.push_join(rid, max(first_token + handoff, kv_ready))

    host_blocks = _host_blocks(fleet, trace)
    prefills = [
        PrefillReplica(
            i,
            profile.prefill,
            chunk,
            profile.transfer,
            profile.kv_bytes_per_token,
            table,
            PrefixCache(blocks, host_blocks),
            on_prefilled,
            profile.serving_overhead_ms,
        )
        for i in range(fleet.prefill_replicas)
    ]
    router = SimulatedRouter(fleet.router, router_cfg)
    host_cost = router_cfg.host_hit_cost
    hash_ids = trace.hash_ids
    block_tokens = trace.block_tokens
    use_cache = hash_ids is not None and (blocks is None or blocks > 0)
    arrival, inputs = table.arrival, table.input
    no_hits = [PrefixHit()] * len(prefills)
    for rid in range(n):
        now = arrival[rid]
        for p in prefills:
            if p.clock <= now:
                p.advance_to(now)
        for d in decodes:
            d.advance_to(now)
        prompt = inputs[rid]
        if local_prefill and _prefilled_locally(rid, now, decodes, table, router_cfg, profile):
            continue
        ids = hash_ids[rid] if use_cache else ()
        if ids and router.uses_prefix:
            hits = [p.cache.match_kv_tiers(ids) for p in prefills]
        else:
            hits = no_hits
        r = router.choose(prefills, now, prompt, hits, block_tokens)
        chosen = prefills[r]
        hit = hits[r] if router.uses_prefix else chosen.cache.match_kv_tiers(ids)
        if ids:
            chosen.cache.insert(ids)
        cached = cached_tokens(hit, block_tokens, prompt)
        table.hit[rid] = cached.total
        # A host block is copied back, not recomputed: it costs a fraction of its prefill.
        table.cached[rid] = cached.total - round(host_cost * cached.host)
        table.prefill_replica[rid] = r
        d = choose_decode(decodes)
        table.decode_replica[rid] = d
        decodes[d].assigned += 1
        if local_prefill and hash_ids[rid]:
            decodes[d].cache.insert(hash_ids[rid])  # its KV is pushed there and stays
        chosen.add(rid, now)
        if progress is not None and rid % PROGRESS_EVERY == PROGRESS_EVERY - 1:
            progress(rid + 1, n)
    for p in prefills:
        p.advance_to(math.inf)
    for d in decodes:
        d.advance_to(math.inf)
    if progress is not None:
        progress(n, n)
    return _result(trace, table, fleet, prefills, decodes, time.perf_counter() - started)


def _result(
    trace: Trace,
    table: RequestTable,
    fleet: FleetConfig,
    prefills: list[PrefillReplica],
    decodes: list[DecodeReplica],
    wall_s: float,
) -> SimResult:
    arrival = trace.arrival_ms
    itl_ms: list[float] = []
    itl_weight: list[int] = []
    itl_tier: list[int] = []
    for d in decodes:
        itl_ms += d.itl.ms
        itl_weight += d.itl.weight
        itl_tier += d.itl.tier
    return SimResult(
        fleet=fleet,
        arrival_ms=arrival,
        ttft_ms=np.asarray(table.ttft) - arrival,
        e2e_ms=np.asarray(table.finish) - arrival,
        input_tokens=trace.input_tokens,
        cached_tokens=np.asarray(table.hit, dtype=np.int64),
        output_tokens=trace.output_tokens,
        priority=np.asarray(table.priority, dtype=np.int64),
        prefill_replica=np.asarray(table.prefill_replica, dtype=np.int64),
        decode_replica=np.asarray(table.decode_replica, dtype=np.int64),
        itl_ms=np.asarray(itl_ms, dtype=np.float64),
        itl_weight=np.asarray(itl_weight, dtype=np.int64),
        itl_priority=np.asarray(itl_tier, dtype=np.int64),
        prefill_busy_ms=[p.busy_ms for p in prefills],
        decode_busy_ms=[d.busy_ms for d in decodes],
        decode_tokens=[d.tokens for d in decodes],
        decode_steps=[d.step_no for d in decodes],
        wall_s=wall_s,
        decode_preemptions=sum(d.preemptions for d in decodes),
        local_prefills=sum(d.local_prefills for d in decodes),
    )
