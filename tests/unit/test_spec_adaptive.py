"""The adaptive controller: k from acceptance and step cost; stats reach Prometheus."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.speculative.adaptive import (
    AcceptanceTracker,
    Candidate,
    StepCostModel,
    choose_k,
    expected_tokens,
)
from services.worker.engine_metrics import EngineMetrics
from shared.sampling.params import SamplingParams
from tests.spec_helpers import OracleProposer


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.9, 0) == 1.0


def _cost(per_token: float, batch_sizes=range(1, 80)) -> StepCostModel:
    cost = StepCostModel()
    for n in batch_sizes:
        cost.observe(n, 0.02 * (1 + per_token * (n - 1)))
    return cost


def test_cheap_verify_and_good_acceptance_speculate_deeply():
    ks = choose_k([Candidate(alpha=0.8, max_k=8)], 8, _cost(0.02))
    assert ks[0] >= 5


def test_poor_acceptance_does_not_speculate():
    assert choose_k([Candidate(alpha=0.05, max_k=8)], 8, _cost(0.3)) == [0]


def test_large_batch_switches_speculation_off():
    """The same acceptance that pays alone loses in a crowd whose step cost grows per token."""
    crowd_cost = StepCostModel()
    for n in range(1, 200):
        # Flat while bandwidth-bound, then linear once the matmuls are compute-bound.
        crowd_cost.observe(n, 0.02 * max(1.0, n / 8))
    alone = choose_k([Candidate(0.5, 6)], 6, crowd_cost)
    crowd = choose_k([Candidate(0.5, 6) for _ in range(32)], 6, crowd_cost)
    assert alone[0] > 0 and crowd == [0] * 32


def test_rows_without_prospects_drop_out():
    ks = choose_k([Candidate(0.9, 6), Candidate(0.01, 6)], 6, _cost(0.1))
    assert ks[0] > 0 and ks[1] == 0


def test_acceptance_tracker_learns_per_request_and_globally():
    tracker = AcceptanceTracker(prior_alpha=0.5)
    for _ in range(20):
        tracker.observe("good", "ngram", 4, 4)
        tracker.observe("bad", "ngram", 4, 0)
    assert tracker.alpha("good", "ngram") > 0.8
    assert tracker.alpha("bad", "ngram") < 0.3
    fresh = tracker.alpha("new", "ngram")  # starts from the global estimate
    assert 0.3 < fresh < 0.8
    tracker.release("good")
    assert tracker.alpha("good", "ngram") == pytest.approx(fresh)


def test_cost_model_interpolates_and_extrapolates():
    cost = StepCostModel()
    assert cost.cost(4) > cost.cost(1)  # prior before anything is measured
    cost.observe(1, 0.010)
    cost.observe(9, 0.018)
    assert cost.cost(5) == pytest.approx(0.014)
    assert cost.cost(20) > 0.018


def test_adaptive_engine_exports_stats_and_metrics(tiny_model):
    prompt = list(range(5, 25)) * 2
    expected = Engine(EngineConfig(num_blocks=64), model=tiny_model).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    )[0]
    engine = Engine(
        EngineConfig(num_blocks=64, speculative_method="adaptive", num_speculative_tokens=4),
        model=tiny_model,
        draft=OracleProposer({tuple(prompt): expected}, wrong_every=5),
    )
    # Step times on a shared CPU are noise at this size: price every step the same, so the
    # controller's choice depends on acceptance only and the test on nothing timed.
    engine.speculator.set_calibration(lambda: {n: 0.01 for n in range(1, 65)})
    engine.speculator.observe_step = lambda num_tokens, seconds: None
    registry = CollectorRegistry()
    engine.step_observers.append(EngineMetrics(registry, engine, "tiny", "decode"))
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    assert engine.generate([prompt], params) == [expected]
    stats = engine.spec_stats()
    assert stats["method"] == "adaptive" and stats["verify_steps"] > 0
    assert stats["mean_accepted"] > 1.0
    assert "draft_unavailable" not in stats
    labels = {"model": "tiny", "role": "decode"}
    drafted = registry.get_sample_value("splitserve_spec_decode_draft_tokens_total", labels)
    accepted = registry.get_sample_value("splitserve_spec_decode_accepted_tokens_total", labels)
    assert drafted == stats["draft_tokens"] and accepted == stats["accepted_tokens"]
    count = registry.get_sample_value("splitserve_spec_decode_acceptance_length_count", labels)
    assert count == stats["verify_steps"]
