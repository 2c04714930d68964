"""The live check's offline parts: slices whose prompts share tokens exactly where their
trace blocks agree, the anchoring of a profile to probe requests, and the simulation on the
anchored profile with the cost of replicas sharing cores."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from services.planner.replica_profile import (
    DecodeModel,
    PrefillModel,
    ReplicaProfile,
    TransferModel,
)
from tools.tuner.calibrate import Anchoring, Probe, anchor
from tools.tuner.fleet import FleetConfig
from tools.tuner.simulator import simulate
from tools.tuner.trace import Trace
from tools.tuner.validate import (
    MIN_GAP_MS,
    at_arrivals,
    make_slice,
    simulate_anchored,
    slice_request,
    spread_ties,
)


def _profile() -> ReplicaProfile:
    return ReplicaProfile(
        prefill=PrefillModel(10.0, 1.0, 0.0),
        decode=DecodeModel(20.0, 2.0, 0.001),
        transfer=TransferModel(1.0, 10.0),
        chunk_tokens=512,
        kv_bytes_per_token=1000,
        max_context=8192,
        kv_capacity_tokens=10_000,
    )


def _mooncake_like() -> Trace:
    return Trace(
        name="m",
        format="mooncake",
        arrival_ms=np.array([0.0, 0.0, 1000.0, 3000.0]),
        input_tokens=np.array([2000, 1500, 4000, 100], dtype=np.int64),
        output_tokens=np.array([300, 10, 900, 5], dtype=np.int64),
        hash_ids=[(0, 1, 2, 3), (0, 1, 5), (0, 1, 2, 3, 6, 7, 8, 9), (11,)],
        block_tokens=512,
    )


def test_slice_prompts_share_tokens_exactly_where_block_ids_agree():
    sl = make_slice("m", _mooncake_like(), _profile(), vocab_size=1000, count=4, length_scale=0.5)
    block = 256  # 512 * 0.5
    lengths = [len(p) for p in sl.prompts]
    assert lengths == sl.trace.input_tokens.tolist() == [1000, 750, 1500, 50]
    assert sl.trace.output_tokens.tolist() == [64, 5, 64, 2]  # capped at 64, at least 2
    a, b, c, d = sl.prompts
    assert a[: 2 * block] == b[: 2 * block] and a[2 * block] != b[2 * block]
    assert c[:1000] == a  # c extends a: all four of a's blocks, then its own
    assert d[:50] != a[:50]
    assert all(100 <= t < 900 for p in sl.prompts for t in p)


def test_slice_arrivals_keep_their_pattern_at_the_target_utilization():
    profile = _profile()
    sl = make_slice("m", _mooncake_like(), profile, 1000, count=4, utilization=0.5)
    busy = sum(profile.prefill_ms(int(n)) for n in sl.trace.input_tokens)
    assert sl.trace.arrival_ms[-1] == pytest.approx(busy / 0.5)
    # Trace times 0, 0, 1000, 3000 stretched: the tie is spread by MIN_GAP_MS (in trace
    # order), the rest keep their times.
    arrivals = sl.trace.arrival_ms
    assert arrivals[1] - arrivals[0] == MIN_GAP_MS
    assert arrivals[3] == pytest.approx(3 * arrivals[2])


def test_spread_ties_keeps_trace_order_and_never_moves_an_arrival_earlier():
    arrivals = np.array([0.0, 0.0, 0.0, 5.0, 100.0, 100.0, 130.0])
    spread = spread_ties(arrivals, 20.0)
    # A burst of three at 0 goes 0, 20, 40; 5 comes after 40; 100 stays, its twin goes to
    # 120; 130 is 10 after that, so it moves to 140.
    assert spread.tolist() == [0.0, 20.0, 40.0, 60.0, 100.0, 120.0, 140.0]
    assert (spread >= arrivals).all() and (np.diff(spread) >= 20.0).all()
    assert arrivals.tolist() == [0.0, 0.0, 0.0, 5.0, 100.0, 100.0, 130.0]  # not modified
    assert spread_ties(np.array([]), 20.0).tolist() == []


def test_anchoring_recovers_speed_overhead_and_a_busy_neighbours_cost():
    profile = _profile()

    # The first token is streamed before the KV push: none of the push is in it.
    def first_token(n: int, slowdown: float) -> float:
        return slowdown * profile.prefill_ms(n) + 20.0

    # The stack runs prefill 1.5x slower than profiled plus 20 ms of serving path, decode
    # 1.2x slower, and prefill a further 2x slower while the decode replica is busy.
    alone = [
        Probe(n, first_token(n, 1.5), 1.2 * profile.decode.step(1, n + 7), False)
        for n in (32, 256, 1024)
    ]
    # ... while a decode step takes 1.4x longer when a prompt prefills beside it.
    busy = [Probe(n, first_token(n, 3.0), 0.0, True, s) for n, s in ((128, 1.3), (512, 1.5))]
    result = anchor(profile, alone + busy)
    assert result.prefill_factor == pytest.approx(1.5, rel=1e-6)
    assert result.serving_overhead_ms == pytest.approx(20.0, rel=1e-6)
    assert result.decode_factor == pytest.approx(1.2, rel=1e-6)
    assert result.busy_prefill_slowdown == pytest.approx(2.0, rel=1e-6)
    assert result.busy_decode_slowdown == pytest.approx(1.4, rel=1e-6)
    anchored = result.profile
    assert anchored.prefill_ms(300) == pytest.approx(1.5 * profile.prefill_ms(300))
    assert anchored.serving_overhead_ms == pytest.approx(20.0)
    assert anchored.decode.step(4, 4000) == pytest.approx(1.2 * profile.decode.step(4, 4000))


def test_anchored_simulation_charges_sharing_the_cores_in_proportion_to_the_neighbour():
    profile = _profile()
    trace = make_slice("m", _mooncake_like(), profile, 1000, count=4, utilization=0.5).trace
    fleet = FleetConfig(2, 1, router="kv_aware")

    def anchoring(prefill_slowdown: float, decode_slowdown: float) -> Anchoring:
        return Anchoring(profile, 1.0, 0.0, 1.0, prefill_slowdown, decode_slowdown)

    alone, factors = simulate_anchored(trace, anchoring(1.0, 1.0), fleet)
    assert factors == {"prefill_factor": 1.0, "decode_factor": 1.0}
    plain = simulate(trace, profile, fleet)
    assert alone.ttft_ms.tolist() == pytest.approx(plain.ttft_ms.tolist())

    shared, factors = simulate_anchored(trace, anchoring(2.0, 1.5), fleet)
    busy = shared.summary()
    # The factors are those the simulation it returns ran with, one settling round behind.
    assert 1.0 < factors["prefill_factor"] < 2.0 and 1.0 < factors["decode_factor"] < 1.5
    assert busy["prefill_utilization"] > 0 and busy["decode_utilization"] > 0
    assert np.all(shared.ttft_ms >= alone.ttft_ms - 1e-9)
    assert shared.latency()["ttft_p50_ms"] > alone.latency()["ttft_p50_ms"]


def test_slice_requests_are_sent_at_their_arrivals_and_returned_in_order():
    profile = _profile()
    sl = make_slice("m", _mooncake_like(), profile, 1000, count=4, utilization=50.0)
    sent: list[tuple[int, float]] = []

    async def send(client, i: int) -> int:
        sent.append((i, time.perf_counter() - start))
        await asyncio.sleep(0.05 * (4 - i))  # early requests answer last
        return i

    start = time.perf_counter()
    assert asyncio.run(at_arrivals(sl, send)) == [0, 1, 2, 3]
    assert [i for i, _ in sent] == [0, 1, 2, 3]
    # Never before its arrival (open loop: a slow reply does not hold the next one back).
    assert all(at >= sl.trace.arrival_ms[i] / 1e3 for i, at in sent)
    body = slice_request("m", sl, 2)
    assert body["prompt"] == sl.prompts[2] and body["max_tokens"] == sl.trace.output_tokens[2]
