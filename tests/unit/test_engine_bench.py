"""`bench engine`'s decode rate counts only steps in which every sequence of the batch decodes."""

from __future__ import annotations

import pytest

from services.bench import engine_bench


def test_every_sequence_decodes_through_the_measured_steps(tiny_model, monkeypatch):
    seen: list[int] = []
    real_step = engine_bench.Engine.step

    def step(self):
        out = real_step(self)
        seen.append(sum(1 for s in self.sequences.values() if s.output_token_ids))
        return out

    monkeypatch.setattr(engine_bench.Engine, "step", step)
    monkeypatch.setattr(engine_bench, "CONTEXT", 600)  # > one step's 512-token budget
    rate = engine_bench.decode_rate(tiny_model, batch=6, steps=5)
    assert rate > 0
    assert seen[-5:] == [6] * 5  # all six were decoding in each measured step


def test_a_run_where_sequences_finish_early_is_refused(tiny_model, monkeypatch):
    monkeypatch.setattr(engine_bench, "SamplingParams", _short_params)
    with pytest.raises(RuntimeError, match="sequences decoded to the end"):
        engine_bench.decode_rate(tiny_model, batch=4, steps=8)


def _short_params(**kwargs):
    from shared.sampling.params import SamplingParams

    return SamplingParams(**(kwargs | {"max_tokens": 3}))
