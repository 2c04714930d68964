"""The pipeline behind `choose_pair`: KV-aware choice with its reasons, two coordinators fed
the same events agreeing, and conditional disaggregation."""

from __future__ import annotations

import random

import pytest

from services.coordinator.route.pair_choice import choose_pair
from services.coordinator.route.registry import WorkerInfo, WorkerRegistry
from shared.config.schema import parse_config
from shared.kvblocks.events import KVEvent
from shared.kvblocks.hashing import hash_prompt_blocks
from shared.wire.records import WorkerLoad

MODEL = "SmolLM2-135M-Instruct"
FINGERPRINT = "fp-1"


def make_registry(router: dict | None = None) -> WorkerRegistry:
    cfg = parse_config({"router": router or {"in_flight_tokens": 0}})
    registry = WorkerRegistry(cfg, {MODEL: FINGERPRINT})
    for name, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")):
        registry.register(
            WorkerInfo(
                name, role, MODEL, f"addr-{name}", name, 8192, tokenizer_fingerprint=FINGERPRINT
            )
        )
    return registry


def hashes(tokens: list[int]) -> list[int]:
    return hash_prompt_blocks(tokens, 16, FINGERPRINT.encode())


PROMPT = list(range(1000, 1160))  # 10 blocks


def test_kv_aware_prefers_the_prefix_and_explains_why():
    registry = make_registry()
    registry.apply_events("p1", [KVEvent("stored", tuple(hashes(PROMPT)[:6]), "device", 1)], False)
    decision = choose_pair(registry, MODEL, prompt_token_ids=PROMPT)
    assert decision.prefill.worker_id == "p1"
    text = "\n".join(decision.reasoning)
    assert "p1: cached 96/160 tokens (device 96), work 64, queued 0 → cost 64" in text
    assert "p0: cached 0/160 tokens, work 160, queued 0 → cost 160" in text
    # p1's queue grows past what its prefix saves (96 tokens): p0 takes the next one.
    registry.heartbeat("p1", WorkerLoad(queued_prefill_tokens=97))
    assert choose_pair(registry, MODEL, prompt_token_ids=PROMPT).prefill.worker_id == "p0"


def _event_stream(seed: int) -> dict[str, list[list[tuple]]]:
    rng = random.Random(seed)
    streams: dict[str, list[list[tuple]]] = {}
    for worker in ("p0", "p1", "d0", "d1"):
        seq, batches = 0, []
        for _ in range(6):
            batch = []
            for _ in range(rng.randint(1, 3)):
                seq += 1
                start = rng.randrange(0, 10)
                kind = "stored" if rng.random() < 0.75 else "removed"
                batch.append(KVEvent(kind, tuple(hashes(PROMPT)[: start + 1]), "device", seq))
            batches.append(batch)
        streams[worker] = batches
    return streams


@pytest.mark.parametrize("seed", range(5))
def test_two_coordinators_fed_the_same_events_agree(seed):
    streams = _event_stream(seed)
    decisions = []
    for order_seed in (seed, seed + 100):
        registry = make_registry()
        queues = {w: list(b) for w, b in streams.items()}
        rng = random.Random(order_seed)  # a different interleaving across workers
        while any(queues.values()):
            worker = rng.choice(sorted(w for w, q in queues.items() if q))
            registry.apply_events(worker, queues[worker].pop(0), False)
        for name, queued in (("p0", 40), ("p1", 40), ("d0", 0), ("d1", 0)):
            registry.heartbeat(name, WorkerLoad(queued_prefill_tokens=queued))
        decision = choose_pair(registry, MODEL, prompt_token_ids=PROMPT + [7] * 40)
        decisions.append((decision.describe(), decision.reasoning))
    assert decisions[0] == decisions[1]


def test_local_prefill_on_the_previous_decode_for_a_short_tail():
    registry = make_registry({"in_flight_tokens": 0, "local_prefill_max_tokens": 64})
    turn1 = PROMPT
    registry.apply_events("d1", [KVEvent("stored", tuple(hashes(turn1)), "device", 1)], False)
    turn2 = turn1 + list(range(5000, 5040))  # 40 new tokens
    decision = choose_pair(registry, MODEL, prompt_token_ids=turn2, previous_decode="d1")
    assert decision.prefill is None and decision.decode.worker_id == "d1"
    assert any(
        "local prefill: d1 (served the previous turn) holds 160/200 tokens; tail 40 ≤ 64" in r
        for r in decision.reasoning
    )
    # Without the hint the decode replica with the longest prefix is found in the index.
    decision = choose_pair(registry, MODEL, prompt_token_ids=turn2)
    assert decision.prefill is None and decision.decode.worker_id == "d1"


def test_a_long_tail_goes_through_a_prefill_replica():
    registry = make_registry({"in_flight_tokens": 0, "local_prefill_max_tokens": 64})
    registry.apply_events("d1", [KVEvent("stored", tuple(hashes(PROMPT)), "device", 1)], False)
    turn2 = PROMPT + list(range(5000, 5100))  # 100 new tokens > 64
    decision = choose_pair(registry, MODEL, prompt_token_ids=turn2, previous_decode="d1")
    assert decision.prefill is not None
    assert any("tail 100 > 64: disaggregated" in r for r in decision.reasoning)


def test_a_dead_previous_decode_is_not_used():
    registry = make_registry({"in_flight_tokens": 0, "local_prefill_max_tokens": 64})
    registry.apply_events("d1", [KVEvent("stored", tuple(hashes(PROMPT)), "device", 1)], False)
    registry.mark_dead("d1")
    decision = choose_pair(
        registry, MODEL, prompt_token_ids=PROMPT + [1] * 20, previous_decode="d1"
    )
    assert decision.prefill is not None and decision.decode.worker_id == "d0"
    assert any("holds none of the prompt" in r for r in decision.reasoning)


def test_excluded_workers_are_skipped():
    registry = make_registry()
    decision = choose_pair(registry, MODEL, prompt_token_ids=PROMPT, exclude={"p0", "d0"})
    assert decision.describe() == "p1->d1"
    assert "excluded" in decision.reasoning[0]


def test_colocated_replicas_are_scored_too():
    cfg = parse_config({"models": [{"pools": {"prefill": 0, "decode": 0, "both": 2}}]})
    registry = WorkerRegistry(cfg, {MODEL: FINGERPRINT})
    for name in ("b0", "b1"):
        registry.register(
            WorkerInfo(name, "both", MODEL, name, name, 8192, tokenizer_fingerprint=FINGERPRINT)
        )
    registry.apply_events("b1", [KVEvent("stored", tuple(hashes(PROMPT)), "device", 1)], False)
    decision = choose_pair(registry, MODEL, prompt_token_ids=PROMPT)
    assert decision.prefill is None and decision.decode.worker_id == "b1"
    assert "colocated replicas" in decision.reasoning


def test_a_shared_system_prompt_alone_does_not_make_a_prefill_local():
    registry = make_registry({"in_flight_tokens": 0, "local_prefill_max_tokens": 256})
    system = PROMPT[:32]
    registry.apply_events("d0", [KVEvent("stored", tuple(hashes(system)), "device", 1)], False)
    decision = choose_pair(registry, MODEL, prompt_token_ids=system + [9] * 100)
    assert decision.prefill is not None
    assert any("under 50% of the prompt: disaggregated" in r for r in decision.reasoning)
