"""The analytic profile: FLOPs and bytes per step against hand-computed figures for a dense
Llama and an MoE, the shipped configs against their published parameter counts, the GPU
profile's physics, and the CPU calibration recovering known efficiency factors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.planner.replica_profile import ProfileError, ReplicaProfile, TransferModel
from tools.profiler.analytic import AnalyticModel, Efficiency, Grid, Machine, build_profile
from tools.profiler.analytic_cpu import CpuPeaks, calibrate
from tools.profiler.analytic_gpu import gpu_profile
from tools.profiler.model_shape import ModelShape, read_model_shape
from tools.profiler.roofline import (
    Precision,
    decode_step_cost,
    kv_bytes_per_token,
    model_params,
    prefill_chunk_cost,
    step_cost,
)

CONFIGS = Path(__file__).resolve().parents[2] / "tools" / "tuner" / "data" / "configs"
BF16 = Precision(weight_bytes=2.0, kv_bytes=2.0)

# hidden 64, 2 layers, 4 query heads and 2 KV heads of 16, MLP 128, vocab 1000, untied head.
DENSE = ModelShape("dense", 1000, 64, 2, 4, 2, 16, 128, 4096, False)
# The same attention; every layer MoE: 8 experts of width 32, 2 per token.
MOE = ModelShape(
    "moe", 1000, 64, 2, 4, 2, 16, 0, 4096, False,
    num_experts=8, experts_per_token=2, expert_intermediate_size=32, moe_layers=2,
)  # fmt: skip


def test_dense_prefill_chunk_by_hand():
    # Per layer: q, o 64x64 = 4096 each; k, v 64x32 = 2048 each; MLP 3x64x128 = 24576:
    # 36864, two layers 73728 weights; head 64x1000 = 64000.
    # 10 tokens after 6: 2*73728*10 = 1474560, head row 2*64000 = 128000, attention
    # 4 * 2 layers * 4 heads * 16 * (10 * (6 + 5) = 110 pairs) = 56320.
    cost = prefill_chunk_cost(DENSE, BF16, tokens=10, offset=6)
    assert cost.flops == 1_474_560 + 128_000 + 56_320
    # Bytes: (73728 + 64000) weights x 2; KV 2 (K,V) x 2 layers x 2 heads x 16 x 2 bytes
    # = 256 per token, for the 6 read and the 10 written.
    assert kv_bytes_per_token(DENSE, BF16) == 256
    assert cost.weight_bytes == 275_456
    assert cost.kv_bytes == 256 * 16


def test_dense_decode_step_by_hand():
    # Batch 3, contexts summing to 30: 2*73728*3 + head 2*64000*3 + 4*2*4*16*30.
    cost = decode_step_cost(DENSE, BF16, batch=3, context_sum=30)
    assert cost.flops == 442_368 + 384_000 + 15_360
    assert cost.weight_bytes == 275_456
    assert cost.kv_bytes == 256 * 33  # 30 read, 3 written


def test_moe_decode_step_by_hand():
    # Per layer: attention 12288, router 64x8 = 512, an expert 3x64x32 = 6144; a token runs
    # 2 experts: 12288 + 512 + 12288 = 25088 FLOP-weights per layer, 50176 for both.
    one = decode_step_cost(MOE, BF16, batch=1, context_sum=5)
    assert one.flops == 2 * 50_176 + 2 * 64_000 + 4 * 2 * 4 * 16 * 5
    # One token touches exactly its 2 experts: 25088 weights per layer read, + head.
    assert one.weight_bytes == (2 * 25_088 + 64_000) * 2
    assert one.kv_bytes == 256 * 6
    # Two tokens touch 8 * (1 - (6/8)^2) = 3.5 experts on average; FLOPs count 2 each.
    two = decode_step_cost(MOE, BF16, batch=2, context_sum=10)
    assert two.flops == 2 * 50_176 * 2 + 2 * 64_000 * 2 + 4 * 2 * 4 * 16 * 10
    assert two.weight_bytes == (2 * (12_288 + 512 + 3.5 * 6_144) + 64_000) * 2


def test_moe_bytes_saturate_at_every_expert():
    many = step_cost(MOE, BF16, 10_000, 0, 0, 0)
    assert many.weight_bytes == pytest.approx(model_params(MOE) * 2 - 64_000 * 2)  # no embed


@pytest.mark.parametrize(
    ("config", "total", "active"),
    [
        # Llama 3.1 70B: 70.6B parameters (model card).
        ("llama-3.1-70b-instruct.json", 70.6e9, 70.6e9),
        # Qwen3-30B-A3B: 30.5B total, 3.3B activated (model card).
        ("qwen3-30b-a3b.json", 30.5e9, 3.3e9),
    ],
)
def test_shipped_configs_match_published_parameter_counts(config, total, active):
    shape = read_model_shape(CONFIGS / config)
    assert model_params(shape) == pytest.approx(total, rel=0.02)
    # FLOPs per token / 2 are the active weights (plus the head's row).
    per_token = decode_step_cost(shape, BF16, 1, 0).flops / 2
    embed = shape.hidden_size * shape.vocab_size
    assert per_token + embed == pytest.approx(active, rel=0.03)


def test_gpu_profile_physics():
    shape = read_model_shape(CONFIGS / "llama-3.1-70b-instruct.json")
    with pytest.raises(ProfileError, match="raise --tp"):
        gpu_profile(shape, "h200", tp=1)  # 141 GB of bf16 weights leave no room for KV
    h200 = gpu_profile(shape, "h200", tp=4)
    h100 = gpu_profile(shape, "h100", tp=4)
    # Decode is bandwidth bound: 4.8 vs 3.35 TB/s; prefill of a long prompt compute bound
    # (same GH100 FLOP/s).
    ratio = h100.decode.step(1, 1024) / h200.decode.step(1, 1024)
    assert ratio == pytest.approx(4.8 / 3.35, rel=0.1)
    assert h100.prefill_ms(16384) == pytest.approx(h200.prefill_ms(16384), rel=0.1)
    assert h200.kv_capacity_tokens > h100.kv_capacity_tokens
    assert h200.meta["kind"] == "analytic"
    assert h200.meta["signature"]["processor"] == "NVIDIA H200"
    # It loads back like a measured profile.
    again = ReplicaProfile.from_dict(json.loads(json.dumps(h200.to_dict())))
    assert again.decode == h200.decode


def test_moe_profile_decode_grows_with_touched_experts():
    shape = read_model_shape(CONFIGS / "qwen3-30b-a3b.json")
    p = gpu_profile(shape, "h200")
    assert p.decode.experts == 128 and p.decode.experts_ms > 0
    assert p.meta["fit_max_rel_error"]["decode"] < 0.05
    # Batch 1 reads 8 of 128 experts, batch 64 nearly all: far dearer than the dense term.
    assert p.decode.step(64, 64 * 512) > 3 * p.decode.step(1, 512)


def test_attention_flops_are_counted_apart():
    cost = prefill_chunk_cost(DENSE, Precision(2.0), 128, 256)
    attended = 128 * (256 + 128 / 2)
    assert (
        cost.attention_flops == 4.0 * DENSE.num_layers * DENSE.num_heads * DENSE.head_dim * attended
    )
    assert 0 < cost.attention_flops < cost.flops
    # An efficiency without its own attention factor times attention like the GEMMs.
    assert Efficiency(0.5, 0.5, 0.5, 0.0, "x").attention_compute == 0.5
    with pytest.raises(ValueError):
        Efficiency(0.5, 0.5, 0.5, 0.0, "x", attention=0.0)


def test_cpu_calibration_recovers_known_efficiencies():
    machine = Machine("cpu", "cpu", flops_per_ms=1e8, bytes_per_ms=1e7, overlap=False)
    # Attention's FLOPs run far below the GEMMs' rate, as the paged attention does on a CPU.
    prefill = Efficiency(0.6, 0.9, 0.3, 0.0, "truth", attention=0.1)
    decode = Efficiency(0.4, 0.7, 0.2, 0.0, "truth")
    fp32 = Precision(4.0, 4.0)
    truth = AnalyticModel(DENSE, machine, fp32, fp32, prefill, decode, 32)
    grid = Grid((64, 128, 256), (0.0, 0.5, 0.9), (1, 4, 16), (64, 256))
    measured = build_profile(
        truth,
        grid,
        TransferModel(1.0, 1.0),
        10_000,
        {"signature": None, "weights": "fp32"},
    )
    cal = calibrate(DENSE, measured, CpuPeaks(100.0, 10.0, 1))
    assert cal.prefill.compute == pytest.approx(0.6, rel=1e-6)
    assert cal.prefill.attention == pytest.approx(0.1, rel=1e-6)
    assert cal.prefill.kv_memory == pytest.approx(0.3, rel=1e-6)
    # A decode step's attention FLOPs and KV bytes both grow as batch x context, so the fit
    # may share that time between their factors: the GEMMs' factor is still pinned down.
    assert cal.decode.compute == pytest.approx(0.4, rel=1e-2)
    assert cal.error < 1e-3  # exact but for the near-collinear decode terms above
