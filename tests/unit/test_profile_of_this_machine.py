"""`bench tune --live` never simulates a foreign profile silently: without --profile it takes
this machine's cached profile (same signature) or measures one; the shipped profile is
reported as of an unknown machine."""

from __future__ import annotations

import pytest

from services.planner.replica_profile import load_profile
from tools.profiler import local
from tools.tuner import bench
from tools.tuner.basis import profile_basis
from tools.tuner.cli_run import default_profile_path


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


def test_a_cached_profile_with_this_signature_is_used(cache_home, monkeypatch):
    shipped = load_profile(default_profile_path())
    path = local.cache_path("auto", 1, quick=True)
    assert str(path).startswith(str(cache_home))
    shipped.save(path)

    def no_measuring(**_):
        raise AssertionError("measured although a profile of this machine is cached")

    monkeypatch.setattr("tools.profiler.run.run_profile", no_measuring)
    profile, stored, cached = local.profile_of_this_machine("auto", 1, quick=True)
    assert cached and stored == str(path)
    assert profile.decode == shipped.decode
    # Another thread count is another signature: not served from this entry.
    assert local.cache_path("auto", 2, quick=True) != path


def test_without_a_cached_profile_one_is_measured_and_cached(cache_home, monkeypatch):
    shipped = load_profile(default_profile_path())
    calls = []

    def fake_measure(**kwargs):
        calls.append(kwargs)
        return shipped

    monkeypatch.setattr("tools.profiler.run.run_profile", fake_measure)
    _, stored, cached = local.profile_of_this_machine("auto", 1, quick=True)
    assert not cached and calls == [
        {"weights": "auto", "model_path": None, "threads": 1, "quick": True}
    ]
    _, again, cached = local.profile_of_this_machine("auto", 1, quick=True)
    assert cached and again == stored and len(calls) == 1


def test_bench_live_takes_this_machines_profile(monkeypatch):
    shipped = load_profile(default_profile_path())
    monkeypatch.setattr(
        local, "profile_of_this_machine", lambda *a, **k: (shipped, "/cache/p.json", True)
    )
    profile, path, source = bench._bench_profile(None, live=True)
    assert path == "/cache/p.json" and source == "this machine, cached"
    _, path, source = bench._bench_profile(None, live=False)
    assert source == "shipped" and path == str(default_profile_path())


def test_the_shipped_profile_says_it_is_foreign(capsys):
    basis = profile_basis(load_profile(default_profile_path()), None)
    assert not basis["check"]["matches"]
    assert "no hardware signature" in capsys.readouterr().err


def test_a_change_to_the_native_kernels_is_another_profile(cache_home, monkeypatch):
    # The replicas run the native step; a profile timed on its old source is stale.
    before = local.cache_path("auto", 1, quick=True)
    monkeypatch.setattr(local, "native_source_digest", lambda: "another-kernel-source")
    assert local.cache_path("auto", 1, quick=True) != before


def test_the_profiler_chooses_auto_formats_for_the_kv_type_replicas_serve(monkeypatch):
    # `auto` times formats over the pool they will read; the profile must time the choice
    # made for the served KV type (fp16 here), not for the fp32 default of the loader.
    from engine.kvcache.kv_dtype import resolve_kv_dtype
    from shared.config import engine_defaults
    from tools.profiler.run import run_profile

    seen = {}

    class Stop(Exception):
        pass

    def loader(source, weights, threads=None, kv_dtype=None, **_):
        seen.update(weights=weights, kv_dtype=kv_dtype)
        raise Stop

    monkeypatch.setattr("engine.core.model_setup.load_serving_model", loader)
    with pytest.raises(Stop):
        run_profile(weights="auto", threads=1, quick=True, progress=lambda _: None)
    served, _ = resolve_kv_dtype(engine_defaults.KV_CACHE_DTYPE)
    assert seen == {"weights": "auto", "kv_dtype": served}
