"""`weights: auto`: formats chosen by measurement among those the quality gate allows."""

from __future__ import annotations

import pytest
import torch

from engine.core.model_setup import load_serving_model
from engine.model.formats import choose, pick
from engine.model.tiny import tiny_checkpoint
from engine.quality.require import eligible_formats


def _t(prefill: float, b1: float, b8: float) -> dict[str, float]:
    return {"prefill_ms_per_token": prefill, "decode_b1_ms": b1, "decode_b8_ms": b8}


def test_each_path_gets_its_fastest_format():
    timings = {
        "fp32": _t(0.8, 20.0, 45.0),
        "bf16": _t(0.4, 24.0, 34.0),
        "native": _t(2.4, 8.0, 30.0),
    }
    assert pick(timings) == ("bf16", "native")


def test_the_choice_depends_on_the_timings_alone():
    timings = {"fp32": _t(1.0, 10.0, 40.0), "native": _t(1.0, 10.0, 40.0)}
    assert pick(timings) == pick(dict(reversed(list(timings.items())))) == ("fp32", "fp32")


def test_a_machine_without_fast_bf16_never_gets_bf16():
    # The AVX2-only figures from the issue: bf16 prefill 6.6x slower than fp32.
    timings = {"fp32": _t(3.4, 66.0, 150.0), "bf16": _t(22.4, 66.0, 150.0)}
    assert pick(timings)[0] == "fp32"


def test_one_native_build_per_model_even_when_each_path_prefers_another():
    timings = {
        "bf16": _t(2.0, 9.0, 30.0),
        "native": _t(1.0, 8.0, 30.0),
        "native-a8": _t(1.5, 6.0, 20.0),
    }
    assert pick(timings) == ("native-a8", "native-a8")
    timings["native-a8"] = _t(2.5, 6.0, 20.0)
    assert pick(timings) == ("bf16", "native-a8")


def test_a_native_decode_build_nearly_as_fast_for_prompts_serves_both_paths():
    timings = {"bf16": _t(1.20, 40.0, 60.0), "native-a8": _t(1.26, 6.0, 20.0)}
    assert pick(timings) == ("native-a8", "native-a8")  # 5% slower: one copy of the weights
    timings["native-a8"] = _t(1.40, 6.0, 20.0)  # 17% slower: the prompt path keeps bf16
    assert pick(timings) == ("bf16", "native-a8")


def test_formats_without_a_passing_report_are_not_eligible(gguf_path, tmp_path):
    eligible, refused = eligible_formats(gguf_path, cache_dir=tmp_path)
    assert eligible == ["fp32", "native"]
    assert set(refused) == {"bf16", "int8", "int4", "native-a8"}
    assert all("never evaluated" in why and "splitserve eval" in why for why in refused.values())


def test_shipped_reports_make_their_formats_eligible(gguf_path):
    eligible, _ = eligible_formats(gguf_path)
    assert {"fp32", "native", "bf16", "int8", "int4", "native-a8"} <= set(eligible)


def test_a_choice_is_measured_once_per_machine_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ck = tiny_checkpoint(seed=0)
    first = choose(ck, ["fp32", "native"], model_key="tiny-0", threads=1)
    assert not first.cached and set(first.timings) == {"fp32", "native"}
    again = choose(ck, ["fp32", "native"], model_key="tiny-0", threads=1)
    assert again.cached and (again.prefill, again.decode) == (first.prefill, first.decode)
    assert again.timings == first.timings
    # Another thread count is another measurement, and so is another KV element type.
    assert not choose(ck, ["fp32", "native"], model_key="tiny-0", threads=2).cached
    half = choose(ck, ["fp32", "native"], model_key="tiny-0", threads=1, kv_dtype=torch.float16)
    assert not half.cached
    # A forced native build (the AVX2 one on an AVX-512 machine) is other kernels.
    from engine.model import formats

    key = formats._cache_path("tiny-0", ["fp32", "native"], 1, torch.float32)
    monkeypatch.setenv("SPLITSERVE_NATIVE_CFLAGS", "-O3 -mavx2 -mfma -mf16c")
    assert formats._cache_path("tiny-0", ["fp32", "native"], 1, torch.float32) != key


def test_formats_are_timed_in_rounds_each_keeping_its_best(monkeypatch):
    """Every format is timed once per round, in turn, so a burst of other work slows one
    round of each format rather than every call of one."""
    from engine.model import formats

    order: list[str] = []

    class Timer:
        def __init__(self, checkpoint, fmt, scale, kv_dtype):
            self.fmt = fmt
            self.rounds = 0

        def time_round(self):
            order.append(self.fmt)
            self.rounds += 1

        def result(self):
            slow = {"fp32": 9.0, "native": 3.0}[self.fmt]
            return _t(slow, slow, 8 * slow)

    monkeypatch.setattr(formats, "_FormatTimer", Timer)
    choice = formats.measure(tiny_checkpoint(seed=0), ["fp32", "native"])
    assert order == ["fp32", "native"] * formats.ROUNDS
    assert (choice.prefill, choice.decode) == ("native", "native")


def test_auto_without_a_compiler_serves_the_torch_path_and_says_why(
    gguf_path, tmp_path, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("SPLITSERVE_NATIVE", "0")
    model, choice = load_serving_model(gguf_path, "auto", threads=1)
    assert choice is not None and "native" in choice.skipped
    assert "SPLITSERVE_NATIVE=0" in choice.skipped["native"]
    assert model.native is None and "native" not in (model.weights, model.decode_weights)


def test_an_ungated_fixed_format_is_refused_with_the_fix(gguf_path, tmp_path, monkeypatch):
    from engine.quality import require

    monkeypatch.setattr(require, "SHIPPED_REPORTS", tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(require.QualityGateError, match="splitserve eval --weights bf16"):
        load_serving_model(gguf_path, "bf16")
