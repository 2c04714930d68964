"""The planner's per-replica capacities read from a profile: hand-computed from the cost
models, capped by the KV pool and the engine's batch, and overridden by explicit flags."""

from __future__ import annotations

import argparse

import pytest

from services.planner.capacity import capacities
from services.planner.replica_profile import (
    DecodeModel,
    PrefillModel,
    ReplicaProfile,
    TransferModel,
)
from tools.commands.planner_cmd import _capacities


def make_profile(kv_capacity: int = 100_000) -> ReplicaProfile:
    return ReplicaProfile(
        prefill=PrefillModel(step_ms=10.0, token_ms=0.1, attn_ms=0.0),
        decode=DecodeModel(base_ms=20.0, seq_ms=0.5, ctx_ms=0.001),
        transfer=TransferModel(1.0, 10.0),
        chunk_tokens=1000,
        kv_bytes_per_token=100,
        max_context=8192,
        kv_capacity_tokens=kv_capacity,
        meta={"kind": "analytic", "signature": {"processor": "NVIDIA H200"}},
    )


def test_capacities_from_the_cost_models():
    cap = capacities(make_profile(), context_tokens=1000, max_seqs=64)
    # A 1000-token chunk takes 10 + 0.1 * 1000 = 110 ms.
    assert cap.prefill_tokens_per_s == pytest.approx(1000 / 0.110)
    # 64 sequences fit (100k tokens of KV, 1000 each); a step: 20 + 0.5*64 + 0.001*64000.
    assert cap.decode_seqs == 64
    assert cap.decode_tokens_per_s == pytest.approx(64 / (20 + 32 + 64) * 1e3)
    assert "analytic profile of NVIDIA H200" in cap.describe()


def test_the_kv_pool_caps_the_batch():
    cap = capacities(make_profile(kv_capacity=10_000), context_tokens=1000, max_seqs=64)
    assert cap.decode_seqs == 10
    assert cap.decode_tokens_per_s == pytest.approx(10 / (20 + 5 + 10) * 1e3)


def test_flags_override_the_profile(tmp_path):
    path = tmp_path / "p.json"
    make_profile().save(path)
    args = argparse.Namespace(
        profile=str(path),
        context_tokens=1000,
        fleet_hardware="h100",
        prefill_tokens_per_s=None,
        decode_tokens_per_s=123.0,
        decode_seqs=None,
    )
    got = _capacities(args)
    assert got["decode_tokens_per_s"] == 123.0
    assert got["prefill_tokens_per_s"] == pytest.approx(1000 / 0.110)
    assert got["decode_seqs"] == 64
    without = argparse.Namespace(
        profile=None,
        context_tokens=1000,
        fleet_hardware=None,
        prefill_tokens_per_s=None,
        decode_tokens_per_s=None,
        decode_seqs=7,
    )
    assert _capacities(without) == {
        "prefill_tokens_per_s": 4000.0,
        "decode_tokens_per_s": 600.0,
        "decode_seqs": 7,
    }


def test_a_profile_for_other_hardware_is_reported(tmp_path, capsys):
    path = tmp_path / "p.json"
    profile = make_profile()
    profile = ReplicaProfile.from_dict(
        profile.to_dict()
        | {
            "meta": {
                "kind": "analytic",
                "signature": {
                    "device": "gpu",
                    "processor": "NVIDIA H200",
                    "flags": "",
                    "cores": 1,
                    "threads": 1,
                    "weights": "bf16",
                    "model": "m",
                    "config_hash": "h",
                },
            }
        }
    )
    profile.save(path)
    args = argparse.Namespace(
        profile=str(path),
        context_tokens=1000,
        fleet_hardware="b200",
        prefill_tokens_per_s=None,
        decode_tokens_per_s=None,
        decode_seqs=None,
    )
    _capacities(args)
    err = capsys.readouterr().err
    assert "WARNING" in err and "NVIDIA B200" in err
