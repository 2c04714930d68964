"""The simulator's resource terms, each on a toy case computed by hand: a decode replica's
KV capacity (joins wait for room), preemption when a batch's growth overflows it (the victim
rejoins later and recomputes its KV), KV pushes sharing a prefill replica's link, and the first
token streamed before its KV push."""

from __future__ import annotations

import numpy as np
import pytest

from services.planner.replica_profile import (
    DecodeModel,
    PrefillModel,
    ReplicaProfile,
    TransferModel,
)
from tools.tuner.colocation import (
    Colocation,
    _overlap,
    _union,
    busy_intervals,
    busy_overlap,
    simulate_colocated,
)
from tools.tuner.fleet import FleetConfig
from tools.tuner.simulator import simulate
from tools.tuner.trace import Trace

# A prefill step costs 1 ms whatever it holds; a decode step 3 ms + 1 ms per sequence.
PREFILL = PrefillModel(1.0, 0.0, 0.0)
DECODE = DecodeModel(3.0, 1.0, 0.0)


def profile(kv_capacity: int, kv_bytes: int = 0) -> ReplicaProfile:
    return ReplicaProfile(
        prefill=PREFILL,
        decode=DECODE,
        transfer=TransferModel(0.0, 1.0),  # no latency, 1 GB/s
        chunk_tokens=1000,
        kv_bytes_per_token=kv_bytes,
        max_context=100_000,
        kv_capacity_tokens=kv_capacity,
    )


def trace(arrivals, inputs, outputs) -> Trace:
    return Trace(
        name="toy",
        format="synthetic",
        arrival_ms=np.asarray(arrivals, dtype=float),
        input_tokens=np.asarray(inputs, dtype=np.int64),
        output_tokens=np.asarray(outputs, dtype=np.int64),
    )


def finish_ms(result) -> list[float]:
    return (result.arrival_ms + result.e2e_ms).tolist()


def test_a_full_decode_replica_makes_the_next_sequence_wait():
    # Two 100-token prompts at 0: the first prefills [0, 1], the second [1, 2] (it arrived
    # after the first step had started); each reply is 11 tokens, 10 of them decoded.
    # Unbounded: A steps alone [1, 5], then with B 9 steps of 5 ms (A ends at 50), B's last
    # alone (54).
    toy = trace([0, 0], [100, 100], [11, 11])
    fleet = FleetConfig(1, 1)
    free = simulate(toy, profile(10_000), fleet)
    assert finish_ms(free) == pytest.approx([50.0, 54.0])
    # 150 tokens of KV hold one 101-token context: the second waits for the first to end
    # (10 steps of 4 ms, at 41), then runs its own 10 (at 81).
    full = simulate(toy, profile(150), fleet)
    assert finish_ms(full) == pytest.approx([41.0, 81.0])
    assert full.decode_preemptions == 0
    # Lifting the limit is the old model.
    lifted = simulate(toy, profile(150), FleetConfig(1, 1, unbounded_decode_kv=True))
    assert finish_ms(lifted) == pytest.approx([50.0, 54.0])


def test_growth_past_capacity_preempts_the_latest_and_it_recomputes():
    # A (50 tokens, 30 to decode) prefills [0, 1], joins at 1; B arrives at 0.5, prefills
    # [1, 2] and joins at the step boundary 5 (A's step [1, 5]): contexts 52 + 51 = 103 of
    # 110, room for (110 - 103) // 2 = 3 steps of 5 ms, to 20. Then B (latest, 3 tokens
    # made) is preempted; A runs its last 26 steps alone (4 ms): ends at 124. B rejoins,
    # recomputes its 54 tokens of KV (one 1 ms prefill step) and runs 27 steps: 124 + 1 +
    # 108 = 233.
    toy = trace([0, 0.5], [50, 50], [31, 31])
    result = simulate(toy, profile(110), FleetConfig(1, 1))
    assert result.decode_preemptions == 1
    assert finish_ms(result) == pytest.approx([124.0, 233.0])
    # B waited from its token at 20 to its first after rejoining (124 + 1 + 4): one gap.
    assert result.itl_ms.max() == pytest.approx(109.0)
    # Every token is still produced exactly once.
    assert result.completed == 2
    assert sum(result.decode_tokens) == 60


def test_pushes_share_the_prefill_replicas_link():
    # The prompts prefill [0, 1] and [1, 2]; their first tokens are out then (streamed
    # before the KV moves). Each pushes 100 tokens x 15 kB = 1.5 MB at 1 GB/s (1e6 bytes per
    # ms): 1.5 ms. The first push holds the link until 2.5, so the second's bytes go
    # 2.5..4.0 (alone it would be done at 3.5). A joins decode at 2.5 and steps [2.5, 6.5];
    # B, its KV in at 4.0, joins at that step's end and steps alone [6.5, 10.5].
    toy = trace([0, 0], [100, 100], [2, 2])
    result = simulate(toy, profile(10_000, kv_bytes=15_000), FleetConfig(1, 1))
    assert result.ttft_ms.tolist() == pytest.approx([1.0, 2.0])
    assert finish_ms(result) == pytest.approx([6.5, 10.5])
    # With two prefill replicas each prefills [0, 1] and pushes over its own link: both KV
    # are in at 2.5 and step together (5 ms at batch 2).
    apart = simulate(toy, profile(10_000, kv_bytes=15_000), FleetConfig(2, 1))
    assert apart.ttft_ms.tolist() == pytest.approx([1.0, 1.0])
    assert finish_ms(apart) == pytest.approx([7.5, 7.5])


def test_the_first_token_does_not_wait_for_the_kv_push():
    # A 100-token prompt prefills [0, 1]; a 100 MB push (1 MB per token) takes 100 ms. The
    # first token is out at 1 whatever the KV weighs; the decode replica's first step waits
    # for the push ([101, 105]), so that wait is in the reply's first inter-token gap.
    toy = trace([0], [100], [2])
    light = simulate(toy, profile(10_000, kv_bytes=0), FleetConfig(1, 1))
    heavy = simulate(toy, profile(10_000, kv_bytes=1_000_000), FleetConfig(1, 1))
    assert light.ttft_ms.tolist() == heavy.ttft_ms.tolist() == pytest.approx([1.0])
    assert finish_ms(light) == pytest.approx([5.0])
    assert finish_ms(heavy) == pytest.approx([105.0])
    assert heavy.itl_ms.tolist() == pytest.approx([104.0])


def test_a_one_token_reply_pushes_nothing():
    # A's reply is its first token, so its KV goes nowhere and B's push has the link to
    # itself: B's KV (1.5 ms of bytes from its prefill's end at 2) is in at 3.5, and its one
    # decode step ends at 7.5.
    toy = trace([0, 0], [100, 100], [1, 2])
    result = simulate(toy, profile(10_000, kv_bytes=15_000), FleetConfig(1, 1))
    assert result.ttft_ms.tolist() == pytest.approx([1.0, 2.0])
    assert finish_ms(result) == pytest.approx([1.0, 7.5])


def test_colocated_replicas_slow_each_other_while_their_busy_times_overlap():
    # A short prompt with a long reply keeps the decode replica busy from 1 ms to ~800 ms; a
    # 500-token prompt arrives at 50 and prefills (one 1 ms step) inside that time.
    toy = trace([0, 50], [10, 500], [200, 2])
    p = profile(10_000)
    alone, factors = simulate_colocated(toy, p, FleetConfig(1, 1), Colocation(1.0, 1.0))
    assert factors == {"prefill_factor": 1.0, "decode_factor": 1.0}
    assert alone.ttft_ms.tolist() == simulate(toy, p, FleetConfig(1, 1)).ttft_ms.tolist()
    # Prefill is busy [0, 1] and [50, 51]; decode from A's first token to the last token.
    intervals = busy_intervals(alone)
    assert intervals["prefill"][0].ravel().tolist() == pytest.approx([0.0, 1.0, 50.0, 51.0])
    last = float(np.max(finish_ms(alone)))
    assert intervals["decode"][0].ravel().tolist() == pytest.approx([1.0, last])
    overlap = busy_overlap(alone)
    # Half of prefill's busy time has decode busy; 1 ms of decode's has prefill busy.
    assert overlap["prefill"] == pytest.approx(0.5)
    assert overlap["decode"] == pytest.approx(1.0 / (last - 1.0))
    shared, factors = simulate_colocated(toy, p, FleetConfig(1, 1), Colocation(2.0, 1.0))
    # So prefill runs at 1 + 0.5 * (2 - 1) of its speed alone, not at decode's utilization
    # (~99% here, which would charge it nearly 2x): the second prompt's step takes 1.5 ms.
    assert factors == {"prefill_factor": pytest.approx(1.5), "decode_factor": 1.0}
    assert shared.ttft_ms[1] == pytest.approx(1.5)
    assert shared.itl_ms.tolist() == pytest.approx(alone.itl_ms.tolist(), rel=0.05)


def test_busy_overlap_counts_the_fraction_of_the_other_kinds_replicas_busy():
    # Overlapping and touching intervals merge; empty and unfinished ones drop out.
    merged = _union(np.array([5.0, 0.0, 2.0, 9.0, 7.0]), np.array([6.0, 3.0, 4.0, 9.0, np.inf]))
    assert merged.tolist() == [[0.0, 4.0], [5.0, 6.0]]
    mine = [np.array([[0.0, 10.0]])]
    # Of two neighbours, one is busy [0, 10] and one [5, 10]: on average 0.75 of them.
    theirs = [np.array([[0.0, 10.0]]), np.array([[5.0, 10.0]])]
    assert _overlap(mine, theirs) == pytest.approx(0.75)
    assert _overlap(mine, [np.array([[20.0, 30.0]])]) == 0.0
    assert _overlap([np.zeros((0, 2))], theirs) == 0.0
