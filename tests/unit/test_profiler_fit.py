"""Fitting the profile's cost models: known coefficients are recovered from synthetic points,
fits never go negative, and a profile file round-trips or is refused with its reason."""

from __future__ import annotations

import json

import pytest

from services.planner.replica_profile import (
    DecodeModel,
    PrefillModel,
    ProfileError,
    ReplicaProfile,
    TransferModel,
    chunk_plan,
    load_profile,
    prefill_alone_ms,
)
from tools.profiler.fit import (
    DecodePoint,
    PrefillPoint,
    TransferPoint,
    fit_decode,
    fit_prefill,
    fit_transfer,
    nnls,
)


def test_chunk_plan_counts_steps_tokens_and_attention():
    # 1000 tokens, 200 cached, chunks of 512: 512 then 288 new tokens.
    steps, new, attended = chunk_plan(1000, 200, 512)
    assert (steps, new) == (2, 800)
    assert attended == pytest.approx(512 * (200 + 256) + 288 * (712 + 144))
    # A fully cached prompt still computes its last token (it samples the first output).
    assert chunk_plan(64, 64, 512)[:2] == (1, 1)


def test_prefill_fit_recovers_known_coefficients():
    truth = PrefillModel(step_ms=20.0, token_ms=0.8, attn_ms=0.0004)
    points = [
        PrefillPoint(n, c, prefill_alone_ms(truth, n, c, 512))
        for n in (128, 256, 512, 1024, 2048)
        for c in (0, n // 2, (n * 9 // 10) // 16 * 16)
    ]
    model, error = fit_prefill(points, 512)
    assert model.step_ms == pytest.approx(truth.step_ms, rel=1e-6)
    assert model.token_ms == pytest.approx(truth.token_ms, rel=1e-6)
    assert model.attn_ms == pytest.approx(truth.attn_ms, rel=1e-6)
    assert error < 1e-9


def test_decode_fit_recovers_known_coefficients_with_noise_bounded():
    truth = DecodeModel(base_ms=15.0, seq_ms=2.0, ctx_ms=0.01, ctx2_ms=1e-7)
    points = []
    for i, (b, c) in enumerate((b, c) for b in (1, 4, 8, 16, 32) for c in (256, 1024, 2048)):
        noise = 1.0 + (0.02 if i % 2 else -0.02)  # +-2% measurement noise
        points.append(DecodePoint(b, c, truth.step(b, b * c) * noise))
    model, error = fit_decode(points)
    for b, c in ((1, 300), (8, 1000), (32, 2000)):
        assert model.step(b, b * c) == pytest.approx(truth.step(b, b * c), rel=0.05)
    assert error < 0.05


def test_transfer_fit_is_latency_plus_bandwidth():
    truth = TransferModel(latency_ms=1.5, gb_s=4.0)
    points = [TransferPoint(n << 20, truth.ms(n << 20)) for n in (1, 4, 16, 64)]
    model, _ = fit_transfer(points)
    assert model.latency_ms == pytest.approx(1.5, rel=1e-6)
    assert model.gb_s == pytest.approx(4.0, rel=1e-6)


def test_nnls_never_returns_a_negative_cost():
    import numpy as np

    # Times that shrink with size would give a negative slope; it is clamped to zero.
    features = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    target = np.array([3.0, 2.0, 1.0])
    coef = nnls(features, target)
    assert (coef >= 0).all() and coef[1] == 0.0


def _profile(**overrides) -> ReplicaProfile:
    fields = dict(
        prefill=PrefillModel(10.0, 1.0, 0.0),
        decode=DecodeModel(5.0, 1.0, 0.001),
        transfer=TransferModel(1.0, 2.0),
        chunk_tokens=512,
        kv_bytes_per_token=1000,
        max_context=4096,
        kv_capacity_tokens=8000,
        meta={"machine": {"measured_at": "2025-01-01T00:00:00Z"}},
    )
    fields.update(overrides)
    return ReplicaProfile(**fields)


def test_a_profile_round_trips_through_its_file(tmp_path):
    profile = _profile()
    profile.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == profile


def test_bad_profiles_are_refused_with_the_field(tmp_path):
    path = tmp_path / "p.json"
    raw = _profile().to_dict()
    del raw["decode"]
    path.write_text(json.dumps(raw))
    with pytest.raises(ProfileError, match=r"p\.json: missing field 'decode'"):
        load_profile(path)
    raw = _profile(prefill=PrefillModel(10.0, -1.0, 0.0)).to_dict()
    path.write_text(json.dumps(raw))
    with pytest.raises(ProfileError, match="prefill.token_ms is negative"):
        load_profile(path)
    path.write_text("{oops")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(path)
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(tmp_path / "none.json")


def test_the_shipped_default_profile_loads():
    from tools.tuner.cli_run import default_profile_path

    profile = load_profile(default_profile_path())
    assert profile.meta["machine"]["measured_at"]
    assert profile.prefill_ms(1024) > profile.prefill_ms(128) > 0
    assert profile.decode.step(8, 8 * 1024) > profile.decode.step(1, 1024) > 0
