"""`splitserve bench kernels`: its CPU fallback, and its GPU path run at toy size on the CPU
through the Triton interpreter (so the script is exercised before a GPU is ever at hand)."""

import json

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed; the kernels cannot be run")

from tools.bench import kernels_bench  # noqa: E402


def test_without_cuda_it_says_so_and_reports_torch_timings(tmp_path, capsys, monkeypatch):
    from tools.commands import kernels_cmd

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    import argparse

    parser = argparse.ArgumentParser()
    kernels_cmd.add_bench(parser.add_subparsers())
    out = tmp_path / "k.json"
    args = parser.parse_args(["kernels", "--quick", "--json", str(out)])
    assert args.handler(args) == 0
    assert "need a CUDA GPU" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["cuda"] is False
    timings = result["cpu"]["torch_reference"]
    assert set(timings) == {
        "decode_b4_ctx1k", "verify_b4_q8_ctx1k", "prefill_chunk256_after256",
        "write_kv_256_tokens",
    }  # fmt: skip
    assert all(t["ms"] > 0 and t["gb_s"] > 0 for t in timings.values())


def test_gpu_path_at_toy_size_in_the_interpreter(monkeypatch):
    monkeypatch.setattr(kernels_bench, "HEADS", 4)
    monkeypatch.setattr(kernels_bench, "KV_HEADS", 2)
    monkeypatch.setattr(kernels_bench, "HEAD_DIM", 16)
    monkeypatch.setattr(kernels_bench, "VERIFY_QUERIES", 3)
    monkeypatch.setattr(kernels_bench, "SPLIT_CONTEXTS", (300,))
    monkeypatch.setattr(kernels_bench, "SPLIT_BATCHES", (1,))
    monkeypatch.setattr(kernels_bench, "measure_copy_gb_s", lambda device: 10.0)
    monkeypatch.setattr(kernels_bench, "_decode_step", lambda device, quick: {"error": "skipped"})
    monkeypatch.setattr(
        kernels_bench,
        "_workloads",
        lambda: {
            "decode": ([1, 1], [40, 17]),
            "verify": ([3, 3], [20, 33]),
            "prefill": ([20], [50]),
            "write_kv": ([4], [4]),
        },
    )
    monkeypatch.setattr(kernels_bench, "median_ms", lambda fn, device, warmup, reps: fn() or 1.0)
    result = kernels_bench._run_gpu(torch.device("cpu"), quick=True)
    for label in ("decode", "verify", "prefill"):
        # bf16 K/V and queries; fp32 accumulation on both sides.
        assert result["kernels"][label]["max_abs_err_vs_torch"] < 2e-2, label
    assert result["kernels"]["write_kv"]["gb_s"] > 0
    verify = result["split_kv_verify"]["b1_ctx300"]
    assert verify["num_splits"] == 2  # 300 keys: two splits of >= 256 at most
    rows = kernels_bench.table_rows({"cuda": True, **result})
    assert any(name.startswith("verify b1_ctx300 split x2") for name, *_ in rows)


def test_device_peak_table_prefers_the_specific_name():
    assert kernels_bench.device_peaks("NVIDIA H100 PCIe") == (2000.0, 756.0)
    assert kernels_bench.device_peaks("NVIDIA H100 80GB HBM3") == (3350.0, 989.0)
    assert kernels_bench.device_peaks("NVIDIA H200") == (4800.0, 989.0)
    assert kernels_bench.device_peaks("NVIDIA L40S") == (864.0, 362.0)
    assert kernels_bench.device_peaks("NVIDIA A10") == (600.0, 125.0)
    assert kernels_bench.device_peaks("Some Future GPU") == (None, None)
