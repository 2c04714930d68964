"""The profiler's measurements on a tiny real engine: the planted prefix is really reused,
and the measured points feed the fits."""

from __future__ import annotations

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from tools.profiler.fit import fit_decode, fit_prefill
from tools.profiler.measure import measure_decode, measure_prefill


def _engine(model) -> Engine:
    return Engine(
        EngineConfig(num_blocks=512, max_num_batched_tokens=64, max_num_seqs=64), model=model
    )


def test_prefill_points_cover_the_grid_and_reuse_the_planted_prefix(tiny_model):
    engine = _engine(tiny_model)
    notes: list[str] = []
    # measure_prefill raises if the engine reused anything but the planted prefix.
    points = measure_prefill(engine, (64, 128), (0.0, 0.5), repeats=1, progress=notes.append)
    assert [(p.tokens, p.cached) for p in points] == [(64, 0), (64, 32), (128, 0), (128, 64)]
    assert all(p.ms > 0 for p in points) and len(notes) == 4
    model, _ = fit_prefill(points, 64)
    assert model.token_ms >= 0 and model.step_ms >= 0


def test_decode_points_run_whole_batches_without_prefilling_them(tiny_model):
    engine = _engine(tiny_model)
    points = measure_decode(engine, (1, 4), (32, 64), steps=2, progress=lambda _: None)
    assert [(p.batch, p.context) for p in points] == [(1, 35), (4, 35), (1, 67), (4, 67)]
    assert all(p.ms > 0 for p in points)
    assert not engine.has_work  # every measured sequence was aborted and its blocks freed
    assert engine.blocks.num_available_blocks == engine.blocks.num_blocks
    fit_decode(points)


def test_each_decode_point_keeps_its_least_disturbed_round(tiny_model, monkeypatch):
    from tools.profiler import measure

    # Round 1 is slow for batch 1, round 2 for batch 4: each point keeps the fast one.
    slow = iter([True, False, False, True])
    real = measure.time_decode

    def timed(engine, prompts, batch, context, steps):
        point = real(engine, prompts, batch, context, steps)
        return measure.DecodePoint(point.batch, point.context, 1000.0 if next(slow) else 1.0)

    monkeypatch.setattr(measure, "time_decode", timed)
    notes: list[str] = []
    points = measure_decode(_engine(tiny_model), (1, 4), (32,), 2, notes.append, rounds=2)
    assert [(p.batch, p.ms) for p in points] == [(1, 1.0), (4, 1.0)]
    assert len(notes) == 2
