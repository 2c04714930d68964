"""A profile's hardware signature: what differs from this machine or the named fleet is
reported, naming the CPU flags that matter; a profile without one is reported as foreign."""

from __future__ import annotations

from dataclasses import replace

from tools.profiler.signature import (
    HardwareSignature,
    differences,
    mismatch_report,
    named_gpu,
)

AVX512 = "avx avx2 avx512_bf16 avx512f fma sse4_2"
MEASURED = HardwareSignature(
    "cpu", "Intel Xeon Platinum 8481C", AVX512, 2, 1, "bf16", "SmolLM2", "abc123"
)


def test_same_machine_matches():
    report = mismatch_report({"signature": MEASURED.to_dict()}, MEASURED, "this machine")
    assert report["matches"] and report["warnings"] == []


def test_another_cpu_is_named_with_its_missing_flags():
    here = replace(MEASURED, processor="Intel(R) Xeon(R) Processor", flags="avx avx2 fma sse4_2")
    diffs = {d.field: d for d in differences(MEASURED, here)}
    assert set(diffs) == {"hardware", "cpu flags"}
    assert "missing here: avx512_bf16, avx512f" in diffs["cpu flags"].other
    report = mismatch_report({"signature": MEASURED.to_dict()}, here, "this machine")
    assert not report["matches"]
    (warning,) = report["warnings"]
    assert "not this machine" in warning and "avx512_bf16" in warning


def test_model_and_weights_differences_unless_hardware_only():
    other = replace(MEASURED, weights="auto: prefill=fp32 decode=native", config_hash="zzz")
    assert {d.field for d in differences(MEASURED, other)} == {"weights", "config_hash"}
    assert differences(MEASURED, other, hardware_only=True) == []


def test_cpu_profile_against_a_gpu_fleet():
    report = mismatch_report(
        {"signature": MEASURED.to_dict(), "kind": "measured"},
        named_gpu("h200"),
        "the fleet's h200",
        hardware_only=True,
    )
    assert not report["matches"]
    assert "NVIDIA H200" in report["warnings"][0]
    assert report["differences"][0]["field"] == "hardware"


def test_gpu_names_from_torch_match_the_datasheet_names():
    analytic = replace(named_gpu("h100"), weights="bf16", model="m", config_hash="h")
    torch_name = HardwareSignature("gpu", "NVIDIA H100 80GB HBM3", "", 1, 1, "", "", "")
    assert differences(analytic, torch_name, hardware_only=True) == []
    assert differences(analytic, named_gpu("h200"), hardware_only=True)[0].field == "hardware"


def test_profile_without_signature_is_reported_as_unknown():
    report = mismatch_report({}, MEASURED, "this machine")
    assert not report["matches"]
    assert "no hardware signature" in report["warnings"][0]
