"""`bench spec`'s timing loop: how often each method is timed, in which order, and what of it is
reported (the decoding itself is replaced by a recorder: the loop's bookkeeping is the subject)."""

from __future__ import annotations

import pytest

from tools.bench import spec_bench


@pytest.fixture
def recorded(monkeypatch):
    calls: list[tuple[str, tuple[int, ...]]] = []

    def decode_run(engine, prompts, params, batch):
        calls.append((engine, tuple(p[0] for p in prompts)))
        # Outputs name the method and the pass, so the test sees which pass was reported.
        outputs = [[p[0], len(calls)] for p in prompts]
        return outputs, 10 * len(prompts), 0.5

    monkeypatch.setattr(spec_bench, "decode_run", decode_run)
    return calls


def test_a_set_that_is_one_batch_is_timed_in_several_rounds_first_place_alternating(recorded):
    engines = {"none": "none", "adaptive": "adaptive"}
    prompts = [[i] for i in range(8)]
    timed = spec_bench.interleaved_runs(engines, prompts, None, 8)  # type: ignore[arg-type]
    rounds = spec_bench.SINGLE_GROUP_ROUNDS
    assert rounds >= 4
    assert len(recorded) == 2 * rounds
    firsts = [recorded[i][0] for i in range(0, len(recorded), 2)]
    assert firsts.count("none") == firsts.count("adaptive") == rounds // 2
    for method, (outputs, tokens, seconds) in timed.items():
        assert tokens == 80 * rounds and seconds == pytest.approx(0.5 * rounds)
        # Every pass decodes the same greedy tokens; the first pass's are the ones compared.
        first = next(i for i, (m, _) in enumerate(recorded, 1) if m == method)
        assert outputs == [[p, first] for p in range(8)]


def test_a_set_of_several_batches_is_timed_once_each(recorded):
    engines = {"none": "none", "ngram": "ngram"}
    prompts = [[i] for i in range(16)]
    timed = spec_bench.interleaved_runs(engines, prompts, None, 8)  # type: ignore[arg-type]
    assert [m for m, _ in recorded] == ["none", "ngram", "ngram", "none"]
    assert recorded[0][1] == tuple(range(8)) and recorded[2][1] == tuple(range(8, 16))
    assert all(len(outputs) == 16 and tokens == 160 for outputs, tokens, _ in timed.values())
