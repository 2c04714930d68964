"""Filter, score and pick, each on its own: the prefix pulls a request to its replica until
that replica's queue outweighs the prefill the prefix saves."""

from __future__ import annotations

import pytest

from services.router.filter import filter_replicas
from services.router.index import PrefixHit
from services.router.pick import pick
from services.router.replica import ReplicaState
from services.router.score import cached_tokens, prefill_cost, score_decode, score_prefill
from shared.config.router import RouterConfig
from shared.wire.records import WorkerLoad

CFG = RouterConfig(in_flight_tokens=0)
MODEL = "m"


def prefill(
    name: str, queued: int = 0, in_flight: int = 0, alive: bool = True, **load
) -> ReplicaState:
    load = WorkerLoad(queued_prefill_tokens=queued, **load)
    return ReplicaState(name, "prefill", MODEL, alive, in_flight, load)


def test_cached_tokens_by_tier_and_never_the_last_token():
    c = cached_tokens(PrefixHit(device=5, host=1), 16, 140)
    assert (c.device, c.host, c.disk) == (80, 16, 0)
    whole = cached_tokens(PrefixHit(device=4), 16, 64)  # the whole prompt is cached
    assert whole.total == 63


def test_host_and_disk_hits_are_cheaper_than_recompute_but_not_free():
    recompute = prefill_cost("a", 160, cached_tokens(PrefixHit(), 16, 160), 0, CFG)
    device = prefill_cost("a", 160, cached_tokens(PrefixHit(device=5), 16, 160), 0, CFG)
    host = prefill_cost("a", 160, cached_tokens(PrefixHit(host=5), 16, 160), 0, CFG)
    disk = prefill_cost("a", 160, cached_tokens(PrefixHit(disk=5), 16, 160), 0, CFG)
    assert device.cost < host.cost < disk.cost < recompute.cost
    assert host.work == pytest.approx(80 + 0.2 * 80)
    assert disk.work == pytest.approx(80 + 0.5 * 80)


@pytest.mark.parametrize("queued", [0, 100, 400, 479, 480, 481, 2000])
def test_the_prefix_wins_until_its_replicas_queue_outweighs_it(queued):
    """'hot' holds 480 of a 500-token prompt; 'cold' holds nothing and is idle."""
    hot = score_prefill(prefill("hot", queued), 500, PrefixHit(device=30), 16, CFG)
    cold = score_prefill(prefill("cold"), 500, PrefixHit(), 16, CFG)
    chosen = pick([hot, cold])
    # Work left on hot: 20 tokens + its queue; on cold: 500. Tie (480) goes to less queued.
    assert chosen.worker_id == ("hot" if queued < 480 else "cold")
    assert "cached 480/500 tokens (device 480)" in hot.describe()
    assert f"queued {queued}" in hot.describe()


def test_a_popular_prefix_spreads_out_as_its_queue_grows():
    """Route a burst of requests sharing a 256-token system prompt held by replica a only:
    once a's queue exceeds what the prefix saves, the others get the overflow."""
    queued = {"a": 0, "b": 0, "c": 0}
    chosen = []
    for _ in range(12):
        scores = [
            score_prefill(
                prefill(name, queued[name]),
                300,
                PrefixHit(device=16) if name == "a" else PrefixHit(),
                16,
                CFG,
            )
            for name in queued
        ]
        best = pick(scores)
        chosen.append(best.worker_id)
        queued[best.worker_id] += int(best.work)
    assert chosen[:5] == ["a"] * 5  # 44 tokens each: the prefix is worth 256 of queue
    assert {"b", "c"} <= set(chosen)
    assert max(queued.values()) - min(queued.values()) <= 300


def test_policies_least_loaded_and_prefix_only():
    hot = prefill("hot", 1000)
    cold = prefill("cold", 10)
    hits = {"hot": PrefixHit(device=30), "cold": PrefixHit()}
    for policy, expected in (("least_loaded", "cold"), ("prefix_only", "hot")):
        scores = [score_prefill(r, 500, hits[r.worker_id], 16, CFG, policy) for r in (hot, cold)]
        assert pick(scores).worker_id == expected


def test_in_flight_requests_count_until_a_heartbeat_reports_them():
    cfg = RouterConfig(in_flight_tokens=128)
    busy = score_prefill(prefill("a", 0, in_flight=3), 100, PrefixHit(), 16, cfg)
    assert busy.queued_tokens == 384


def test_pick_breaks_ties_by_id_not_by_order():
    scores = [score_prefill(prefill(n), 100, PrefixHit(), 16, CFG) for n in ("p2", "p0", "p1")]
    assert pick(scores).worker_id == "p0"
    assert pick(list(reversed(scores))).worker_id == "p0"
    assert pick([]) is None


def test_decode_score_counts_kv_and_sequences():
    light = ReplicaState("d0", "decode", MODEL, load=WorkerLoad(running=2, active_kv_tokens=1000))
    heavy = ReplicaState("d1", "decode", MODEL, load=WorkerLoad(running=8, active_kv_tokens=300))
    assert score_decode(light, CFG).cost == 1000 + 2 * 256
    assert pick([score_decode(light, CFG), score_decode(heavy, CFG)]).worker_id == "d0"


def test_filter_drops_dead_wrong_model_role_and_full_replicas():
    cfg = RouterConfig(max_queued_prefill_tokens=1000, max_waiting=4)
    replicas = [
        prefill("ok"),
        prefill("dead", alive=False),
        ReplicaState("other", "prefill", "other-model"),
        ReplicaState("dec", "decode", MODEL),
        prefill("queued", 5000),
        prefill("waiting", waiting=9),
    ]
    out = filter_replicas(replicas, MODEL, ("prefill",), cfg)
    assert [r.worker_id for r in out.kept] == ["ok"]
    assert any("queued skipped: 5000 queued prefill tokens > 1000" in n for n in out.notes)
    decodes = [
        ReplicaState("d0", "decode", MODEL, load=WorkerLoad(free_blocks=2, total_blocks=100)),
        ReplicaState("d1", "decode", MODEL, load=WorkerLoad(free_blocks=50, total_blocks=100)),
    ]
    assert [r.worker_id for r in filter_replicas(decodes, MODEL, ("decode",), cfg, 10).kept] == [
        "d1"
    ]
    # Every candidate full: the limits are waived, and the reasoning says so.
    waived = filter_replicas(decodes, MODEL, ("decode",), cfg, 80)
    assert [r.worker_id for r in waived.kept] == ["d0", "d1"]
    assert "limits waived" in waived.notes[-1]
