"""The coordinator's worker registry: refusals that name the field, liveness, the KV index."""

from __future__ import annotations

import pytest

from services.coordinator.route.pair_choice import choose_pair
from services.coordinator.route.readiness import fleet_readiness
from services.coordinator.route.registry import RegistrationError, WorkerInfo, WorkerRegistry
from shared.config.schema import parse_config
from shared.kvblocks.events import KVEvent


@pytest.fixture
def registry():
    cfg = parse_config({"coordinator": {"heartbeat_interval_s": 1, "heartbeat_timeout_s": 3}})
    return WorkerRegistry(cfg, {"SmolLM2-135M-Instruct": "abc123"})


def _worker(worker_id: str, role: str, **kw) -> WorkerInfo:
    return WorkerInfo(
        worker_id,
        role,
        "SmolLM2-135M-Instruct",
        f"127.0.0.1:{len(worker_id)}",
        worker_id,
        8192,
        **kw,
    )


@pytest.mark.parametrize(
    ("model", "fingerprint", "block_size", "needle"),
    [
        ("other-model", "abc123", 16, "model 'other-model' is not in the coordinator's config"),
        ("SmolLM2-135M-Instruct", "abc123", 32, "block_size 32 differs"),
        ("SmolLM2-135M-Instruct", "zzz999", 16, "tokenizer fingerprint"),
    ],
)
def test_disagreeing_worker_is_refused_naming_the_field(
    registry, model, fingerprint, block_size, needle
):
    with pytest.raises(RegistrationError, match=needle):
        registry.check(model, fingerprint, block_size, "decode")


def test_ready_while_a_path_exists_and_missing_roles_are_listed(registry):
    status = fleet_readiness(registry)
    assert not status["ready"]
    assert [(m["model"], m["role"]) for m in status["missing"]] == [
        ("SmolLM2-135M-Instruct", "prefill"),
        ("SmolLM2-135M-Instruct", "decode"),
    ]
    registry.register(_worker("p0", "prefill"))
    status = fleet_readiness(registry)
    assert [m["role"] for m in status["missing"]] == ["decode"]
    assert "no routable decode replica" in status["missing"][0]["message"]
    registry.register(_worker("d0", "decode"))
    registry.register(_worker("d1", "decode"))
    assert fleet_readiness(registry)["ready"]
    # One of two decode replicas gone: still a path, still ready.
    registry.mark_dead("d0", "test")
    status = fleet_readiness(registry)
    assert status["ready"] and status["missing"] == []
    assert status["models"]["SmolLM2-135M-Instruct"]["replicas"] == {
        "prefill": 1,
        "decode": 1,
        "both": 0,
    }
    # The last one draining: nothing new can be routed, so not ready.
    registry.heartbeat("d1", registry.workers["d1"].load, draining=True)
    assert [m["role"] for m in fleet_readiness(registry)["missing"]] == ["decode"]
    registry.register(_worker("b0", "both"))
    assert fleet_readiness(registry)["ready"]  # a colocated replica is a path by itself


def test_a_restarted_replica_replaces_its_entry_and_kv(registry):
    registry.register(_worker("d0-pid1", "decode", replica="decode-0@host"))
    registry.register(_worker("d1-pid2", "decode", replica="decode-1@host"))
    registry.apply_events("d0-pid1", [KVEvent("stored", (1, 2), "device", 1)], snapshot=False)
    restarted = WorkerInfo(
        "d0-pid3",
        "decode",
        "SmolLM2-135M-Instruct",
        "127.0.0.1:9999",  # a new address
        "d0-pid3",
        8192,
        replica="decode-0@host",
    )
    registry.register(restarted)
    assert set(registry.workers) == {"d1-pid2", "d0-pid3"}  # no ghost beside it
    assert registry.cached_prefix_blocks("d0-pid1", [1, 2]) == (0, None)
    assert registry.cached_prefix_blocks("d0-pid3", [1, 2]) == (0, None)
    assert {w.worker_id for w in registry.routable("SmolLM2-135M-Instruct")} == {
        "d1-pid2",
        "d0-pid3",
    }
    # Unnamed replicas (older workers) are never merged.
    registry.register(_worker("x-pid4", "decode"))
    registry.register(_worker("x-pid5", "decode"))
    assert {"x-pid4", "x-pid5"} <= set(registry.workers)


def test_a_draining_replica_is_not_routed_to(registry):
    registry.register(_worker("p0", "prefill"))
    registry.register(_worker("d0", "decode"))
    registry.register(_worker("d1", "decode"))
    assert registry.heartbeat("d1", registry.workers["d1"].load, draining=True)
    for _ in range(5):
        decision = choose_pair(registry, "SmolLM2-135M-Instruct", prompt_token_ids=[1, 2, 3])
        assert decision is not None and decision.decode.worker_id == "d0"


def test_missed_heartbeats_leave_the_pool_and_drop_kv(registry):
    registry.register(_worker("p0", "prefill"))
    registry.register(_worker("d0", "decode"))
    registry.apply_events("d0", [KVEvent("stored", (1, 2, 3), "device", 1)], snapshot=False)
    now = registry.workers["d0"].last_seen
    assert set(registry.reap(now + 10)) == {"p0", "d0"}
    assert not registry.workers["d0"].alive
    assert registry.cached_prefix_blocks("d0", [1, 2, 3]) == (0, None)
    assert choose_pair(registry, "SmolLM2-135M-Instruct") is None


def test_kv_index_events_and_snapshot(registry):
    registry.register(_worker("d0", "decode"))
    registry.apply_events(
        "d0",
        [
            KVEvent("stored", (1, 2, 3), "device", 1),
            KVEvent("stored", (4,), "host", 2),
        ],
        False,
    )
    assert registry.cached_prefix_blocks("d0", [1, 2, 3, 4, 9]) == (4, "host")
    registry.apply_events("d0", [KVEvent("removed", (2,), "device", 3)], False)
    assert registry.cached_prefix_blocks("d0", [1, 2, 3]) == (1, "device")
    registry.apply_events("d0", [KVEvent("stored", (7,), "device", 9)], snapshot=True)
    assert registry.cached_prefix_blocks("d0", [1]) == (0, None)
    assert registry.cached_prefix_blocks("d0", [7]) == (1, "device")
    assert registry.workers["d0"].kv_event_seq == 9


def test_least_loaded_pair(registry):
    registry.register(_worker("p0", "prefill"))
    registry.register(_worker("p1", "prefill"))
    registry.register(_worker("d0", "decode"))
    registry.workers["p0"].in_flight = 3
    decision = choose_pair(registry, "SmolLM2-135M-Instruct")
    assert decision.prefill.worker_id == "p1" and decision.decode.worker_id == "d0"
    assert decision.reasoning
