"""`--plot DIR`: benchmark results become PNG figures (CDFs per mode, throughput against
concurrency, acceptance histogram, transfer bandwidth) for whatever data a result holds."""

from __future__ import annotations

from PIL import Image

from tools.bench.load import RequestTiming
from tools.bench.plots import timing_samples, write_plots


def _png_size(path) -> tuple[int, int]:
    with Image.open(path) as image:
        assert image.format == "PNG"
        return image.size


def test_every_figure_the_result_has_data_for(tmp_path):
    result = {
        "samples": {
            "colocated": {"ttft_ms": [80.0, 95.0, 300.0], "itl_ms": [20.0, 22.0, 90.0]},
            "disagg": {"ttft_ms": [70.0, 75.0, 110.0], "itl_ms": [19.0, 20.0, 21.0]},
        },
        "sweep": [
            {"label": "disagg", "concurrency": c, "throughput_tok_s": 10.0 * c} for c in (1, 2, 4)
        ],
        "acceptance_histogram": {"0": 3, "1": 5, "2": 9, "3": 4},
        "backends": {"shm": {"gb_s_1mib": 2.0, "gb_s_16mib": 5.5}, "nixl": "not installed"},
        "memcpy_gb_s": 8.0,
    }
    paths = write_plots("disagg", result, tmp_path / "plots")
    assert sorted(p.name for p in paths) == [
        "disagg_acceptance_histogram.png",
        "disagg_itl_cdf.png",
        "disagg_throughput_vs_concurrency.png",
        "disagg_transfer_bandwidth.png",
        "disagg_ttft_cdf.png",
    ]
    for path in paths:
        width, height = _png_size(path)
        assert width > 300 and height > 200


def test_engine_bench_keys_are_a_throughput_sweep(tmp_path):
    result = {"decode_tok_s_b1": 40.0, "decode_tok_s_b8": 210.0, "decode_tok_s_b32": 500.0}
    (path,) = write_plots("engine", result, tmp_path)
    assert path.name == "engine_throughput_vs_concurrency.png"
    _png_size(path)


def test_nothing_to_draw_writes_nothing(tmp_path):
    assert write_plots("transfer", {"memcpy_gb_s": 8.0, "samples": {}}, tmp_path) == []
    assert list(tmp_path.iterdir()) == []


def test_timing_samples_and_acceptance_lists(tmp_path):
    timings = [
        RequestTiming("chat", ttft_ms=50.0, itl_ms=[10.0, 12.0], tokens=3),
        RequestTiming("chat", error="HTTP 503"),
        RequestTiming("chat", ttft_ms=None),
    ]
    assert timing_samples(timings) == {"ttft_ms": [50.0], "itl_ms": [10.0, 12.0]}
    (path,) = write_plots("x", {"acceptance_histogram": [0, 2, 2, 3]}, tmp_path)
    assert path.name == "x_acceptance_histogram.png"


def test_kernel_results_draw_speedups_and_bandwidth(tmp_path):
    gpu = {
        "split_kv_verify": {
            "b1_ctx1024": {"speedup": 2.5},
            "b1_ctx8192": {"speedup": 6.0},
            "b8_ctx1024": {"speedup": 1.1},
        },
        "kernels": {"decode_b32_ctx4k": {"gb_s": 3100.0}, "write_kv": {"gb_s": 900.0}},
        "spec_hbm_gb_s": 4800.0,
    }
    names = sorted(p.name for p in write_plots("kernels", gpu, tmp_path / "gpu"))
    assert names == ["kernels_kernel_bandwidth.png", "kernels_split_kv_verify_speedup.png"]
    cpu = {"cpu": {"read_gb_s": 12.0, "torch_reference": {"decode_b4_ctx1k": {"gb_s": 3.0}}}}
    (path,) = write_plots("kernels", cpu, tmp_path / "cpu")
    assert path.name == "kernels_kernel_bandwidth.png"
    _png_size(path)


def test_tuner_results_draw_each_fleet_size_tried(tmp_path):
    evaluations = [
        {"prefill_replicas": p, "decode_replicas": d, "ttft_p99_ms": t, "itl_p99_ms": i}
        for p, d, t, i in ((1, 1, 9000.0, 80.0), (2, 1, 2500.0, 85.0), (2, 2, 2400.0, 40.0))
    ]
    result = {
        "traces": {"mooncake conv": {"evaluations": evaluations, "slo": {"ttft_p99_ms": 3000}}}
    }
    (path,) = write_plots("tune", result, tmp_path)
    assert path.name == "tune_mooncake_conv_fleet_sizes.png"
    _png_size(path)


def test_every_bench_command_takes_plot():
    import argparse

    from tools.commands import bench_cmd

    parser = argparse.ArgumentParser()
    bench_cmd.add_command(parser.add_subparsers())
    (bench,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    kinds = next(
        a for a in bench.choices["bench"]._actions if isinstance(a, argparse._SubParsersAction)
    )
    assert {"engine", "disagg", "transfer", "kernels", "overhead", "tune"} <= set(kinds.choices)
    for name, sub in kinds.choices.items():
        assert any("--plot" in a.option_strings for a in sub._actions), name


def test_a_cdf_legend_counts_the_samples_and_skips_empty_series():
    from tools.bench.plots import _cdf

    fig = _cdf({"ours": [1.0, 2.0, 3.0], "peer": []}, "TTFT", "ms")
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["ours (n=3)"]
