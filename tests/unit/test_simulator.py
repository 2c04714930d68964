"""The fleet simulator's behaviour: exact timing of a lone request (the closed-form jumps
against step-by-step arithmetic), conservation, tiers, prefix caching, routing, and
monotonicity in replica counts."""

from __future__ import annotations

import numpy as np
import pytest

from services.planner.replica_profile import (
    DecodeModel,
    PrefillModel,
    ReplicaProfile,
    TransferModel,
    prefill_alone_ms,
)
from shared.config.router import RouterConfig
from tools.tuner.fleet import FleetConfig
from tools.tuner.prefix_cache import PrefixCache
from tools.tuner.simulator import simulate
from tools.tuner.stepmath import run_ms, steps_to_reach, steps_within
from tools.tuner.synthetic import poisson_trace, uniform_trace
from tools.tuner.trace import Trace

PREFILL = PrefillModel(5.0, 1.0, 0.001)
DECODE = DecodeModel(3.0, 1.0, 0.01)
TRANSFER = TransferModel(2.0, 1.0)
# Every prompt through the prefill pool: what the prefill router policies are tested on.
NO_LOCAL_PREFILL = RouterConfig(local_prefill_max_tokens=0)


def make_profile(
    prefill: PrefillModel = PREFILL,
    decode: DecodeModel = DECODE,
    transfer: TransferModel = TRANSFER,
    chunk: int = 100,
    kv_capacity: int = 100_000,
) -> ReplicaProfile:
    return ReplicaProfile(
        prefill=prefill,
        decode=decode,
        transfer=transfer,
        chunk_tokens=chunk,
        kv_bytes_per_token=1000,
        max_context=100_000,
        kv_capacity_tokens=kv_capacity,
    )


def _trace(arrivals, inputs, outputs, hash_ids=None, block_tokens=512.0) -> Trace:
    return Trace(
        name="t",
        format="synthetic",
        arrival_ms=np.asarray(arrivals, dtype=float),
        input_tokens=np.asarray(inputs, dtype=np.int64),
        output_tokens=np.asarray(outputs, dtype=np.int64),
        hash_ids=hash_ids,
        block_tokens=block_tokens,
    )


def test_step_runs_in_closed_form_match_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(300):
        first, growth = rng.uniform(0.1, 50), rng.choice([0.0, rng.uniform(0, 5)])
        span = rng.uniform(0, 2000)
        k = steps_within(first, growth, span)
        assert run_ms(k, first, growth) <= span < run_ms(k + 1, first, growth)
        reach = steps_to_reach(first, growth, span)
        assert run_ms(reach, first, growth) >= span
        assert reach == 0 or run_ms(reach - 1, first, growth) < span


def test_a_lone_request_takes_exactly_its_chunks_transfer_and_decode_steps():
    profile = make_profile()
    trace = _trace([0.0], [350], [5])
    result = simulate(trace, profile, FleetConfig(1, 1))
    prefill = prefill_alone_ms(profile.prefill, 350, 0, 100)  # 4 chunks: 100, 100, 100, 50
    # The first token is streamed as soon as it is sampled; the KV push follows it.
    assert result.ttft_ms[0] == pytest.approx(prefill)
    push = profile.transfer.ms(350 * 1000)
    # Four decode steps at batch 1, context 351, 352, 353, 354, once the KV has landed.
    steps = [profile.decode.step(1, 351 + i) for i in range(4)]
    assert result.e2e_ms[0] == pytest.approx(prefill + push + sum(steps))
    # The tokens' gaps: four of them, weighted; the first also waits for the push.
    assert result.itl_weight.sum() == 4
    mean = np.average(result.itl_ms, weights=result.itl_weight)
    assert mean == pytest.approx((push + sum(steps)) / 4)


def test_every_request_completes_and_every_token_is_produced_once():
    trace = poisson_trace(2000, rate_per_s=20, mean_input=300, mean_output=30, seed=3)
    result = simulate(trace, make_profile(), FleetConfig(3, 2, decode_max_batch=8))
    assert result.completed == len(trace)
    assert np.all(result.ttft_ms > 0) and np.all(result.e2e_ms >= result.ttft_ms)
    assert result.itl_weight.sum() == int((trace.output_tokens - 1).sum())
    assert sum(result.decode_tokens) == int((trace.output_tokens - 1).sum())
    assert set(result.prefill_replica.tolist()) == {0, 1, 2}
    assert set(result.decode_replica.tolist()) == {0, 1}


def test_higher_tiers_are_admitted_first():
    # A long prompt holds the replica; then a batch-tier and a priority-tier prompt queue up.
    trace = _trace([0.0, 1.0, 2.0], [1000, 200, 200], [1, 1, 1])
    priorities = np.array([1, 3, 0])
    result = simulate(trace, make_profile(), FleetConfig(1, 1), priorities)
    first_out = trace.arrival_ms + result.ttft_ms
    assert first_out[2] < first_out[1]  # priority overtakes batch, though it came later
    flat = simulate(trace, make_profile(), FleetConfig(1, 1))
    assert (trace.arrival_ms + flat.ttft_ms)[1] < (trace.arrival_ms + flat.ttft_ms)[2]


def test_a_shared_prefix_is_reused_on_the_replica_that_holds_it():
    ids = [(1, 2, 3), (1, 2, 9), (7,)]
    trace = _trace([0.0, 5000.0, 10000.0], [300, 300, 100], [2, 2, 2], ids, block_tokens=100)
    fleet = FleetConfig(2, 1, router="prefix_only")
    result = simulate(trace, make_profile(), fleet, router_config=NO_LOCAL_PREFILL)
    assert result.cached_tokens.tolist() == [0, 200, 0]
    assert result.prefill_replica[0] == result.prefill_replica[1]
    # Without room in the cache nothing is reused.
    no_cache = simulate(
        trace, make_profile(), FleetConfig(2, 1, cache_tokens=0), router_config=NO_LOCAL_PREFILL
    )
    assert no_cache.cached_tokens.tolist() == [0, 0, 0]


def test_a_decode_replica_holding_the_conversation_prefills_its_tail_itself():
    # Turn 1 (blocks 1, 2, 3 of 100 tokens) goes through the prefill pool, and its KV stays
    # on decode replica 0. Turn 2 (1, 2, 9) finds 200 of its 300 tokens there: >= 50% held
    # and a 100-token tail <= 256, so that replica prefills the tail itself: one chunk of
    # 100 new tokens over 200 cached, 5 + 100 + 0.001 * 100 * 250 = 130 ms, no transfer.
    ids = [(1, 2, 3), (1, 2, 9)]
    trace = _trace([0.0, 5000.0], [300, 300], [2, 3], ids, block_tokens=100)
    profile = make_profile()
    result = simulate(trace, profile, FleetConfig(1, 1))
    assert result.local_prefills == 1
    assert result.prefill_replica.tolist() == [0, -1]
    assert result.cached_tokens.tolist() == [0, 200]
    assert result.ttft_ms[1] == pytest.approx(130.0)
    # Then its two decode steps at context 301 and 302.
    steps = profile.decode.step(1, 301) + profile.decode.step(1, 302)
    assert result.e2e_ms[1] == pytest.approx(130.0 + steps)
    # The rule is the live router's: off, under half the prompt held, or too long a tail,
    # and the prefill pool does it (and the transfer follows).
    off = simulate(trace, profile, FleetConfig(1, 1), router_config=NO_LOCAL_PREFILL)
    short = RouterConfig(local_prefill_max_tokens=99)
    too_long = simulate(trace, profile, FleetConfig(1, 1), router_config=short)
    little = _trace([0.0, 5000.0], [300, 300], [2, 3], [(1, 2, 3), (1, 8, 9)], block_tokens=100)
    under_half = simulate(little, profile, FleetConfig(1, 1))
    for other in (off, too_long, under_half):
        assert other.local_prefills == 0 and other.prefill_replica.tolist() == [0, 0]
    assert off.ttft_ms[1] == pytest.approx(130.0)  # the prefill replica holds it too
    assert under_half.ttft_ms[1] > 130.0


def test_a_local_prefill_stalls_the_decode_batch_it_joins():
    # Turn 1 decodes 200 tokens (about 5 ms a step); turn 2 arrives at 500 ms, while it
    # runs, and its 130 ms local prefill is a stall the running sequence's next gap waits
    # through. A one-token reply finishes at its first token.
    ids = [(1, 2, 3), (1, 2, 9)]
    trace = _trace([0.0, 500.0], [300, 300], [200, 1], ids, block_tokens=100)
    result = simulate(trace, make_profile(), FleetConfig(1, 1))
    assert result.local_prefills == 1
    assert result.ttft_ms[1] == result.e2e_ms[1]
    assert 130.0 <= result.ttft_ms[1] < 140.0  # the stall starts at the next step boundary
    # The stalled gap: the stall and one step at batch 1, context between 301 and 501.
    step = make_profile().decode.step
    assert 130.0 + step(1, 301) <= result.itl_ms.max() <= 130.0 + step(1, 501)
    alone = simulate(_trace([0.0], [300], [200]), make_profile(), FleetConfig(1, 1))
    assert result.e2e_ms[0] == pytest.approx(alone.e2e_ms[0] + 130.0)


def test_prefix_cache_evicts_least_recent_and_matches_only_leading_blocks():
    cache = PrefixCache(4)
    cache.insert([1, 2, 3])
    cache.insert([7, 8])  # 5 blocks > 4: the least recent, the tail of [1, 2, 3], goes
    assert cache.match([1, 2, 3]) == 2
    assert cache.match([1, 5, 3]) == 1  # a match stops at the first block not held
    assert cache.match([7, 8, 9]) == 2
    assert len(cache) == 4
    assert PrefixCache(None).match([]) == 0


def test_router_policies_place_requests_as_designed():
    trace = uniform_trace(6, 1.0, 200, 2)
    rr = simulate(trace, make_profile(), FleetConfig(3, 1, router="round_robin"))
    assert rr.prefill_replica.tolist() == [0, 1, 2, 0, 1, 2]
    ll = simulate(trace, make_profile(), FleetConfig(3, 1, router="least_loaded"))
    assert sorted(np.bincount(ll.prefill_replica).tolist()) == [2, 2, 2]
    # kv_aware leaves the replica holding the prefix once its queue outweighs the saving.
    ids = [(1, 2)] * 4  # half of each 400-token prompt is a shared prefix
    busy = _trace([0, 1, 2, 3], [400] * 4, [2] * 4, ids, block_tokens=100)
    kv = simulate(
        busy, make_profile(), FleetConfig(2, 1, router="kv_aware"), router_config=NO_LOCAL_PREFILL
    )
    prefix = simulate(
        busy,
        make_profile(),
        FleetConfig(2, 1, router="prefix_only"),
        router_config=NO_LOCAL_PREFILL,
    )
    assert set(prefix.prefill_replica.tolist()) == {0}
    assert set(kv.prefill_replica.tolist()) == {0, 1}


@pytest.fixture(scope="module")
def busy_trace() -> Trace:
    return poisson_trace(1500, rate_per_s=8, mean_input=400, mean_output=40, seed=11)


def test_more_prefill_replicas_never_raise_ttft_p99(busy_trace):
    profile = make_profile()
    p99 = [
        simulate(busy_trace, profile, FleetConfig(p, 2)).latency()["ttft_p99_ms"]
        for p in range(1, 6)
    ]
    assert all(b <= a + 1e-9 for a, b in zip(p99, p99[1:], strict=False)), p99
    assert p99[0] > 2 * p99[-1]  # the first is overloaded: the trend is real, not flat


def test_more_decode_replicas_never_raise_itl_p99(busy_trace):
    profile = make_profile(decode=DecodeModel(3.0, 4.0, 0.02))
    p99 = [
        simulate(busy_trace, profile, FleetConfig(4, d)).latency()["itl_p99_ms"]
        for d in range(1, 6)
    ]
    assert all(b <= a + 1e-9 for a, b in zip(p99, p99[1:], strict=False)), p99
    assert p99[0] > 2 * p99[-1]
