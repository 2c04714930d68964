"""PNG figures beside a benchmark's JSON, for what is easier seen than read.

`write_plots(kind, result, directory)` draws every figure the result has data for and
returns the files it wrote. It reads these keys of a bench result (any subset):

- `samples`: {label: {"ttft_ms": [...], "itl_ms": [...]}} per mode or policy -> TTFT and
  ITL CDFs (build an entry from load-generator timings with `timing_samples`);
- `sweep`: [{"label", "concurrency", "throughput_tok_s"}, ...] -> throughput against
  concurrency, one line per label; the engine bench's `decode_tok_s_b<N>` keys are read as
  such a sweep too;
- `acceptance_histogram`: {accepted draft tokens: count} (or a list of per-step accepted
  counts) -> the speculative-decoding acceptance histogram;
- `backends`: {name: {"gb_s_1mib": ..., "gb_s_16mib": ...}} with `memcpy_gb_s` -> transfer
  bandwidth against message size, memcpy drawn as the limit;
- `split_kv_verify`: {"b<B>_ctx<C>": {"speedup": ...}} -> split-KV verify speedup against
  context, one line per batch size;
- `kernels` with `spec_hbm_gb_s` (GPU), or `cpu.torch_reference` with `cpu.read_gb_s` ->
  each kernel's GB/s as bars beside the bandwidth limit;
- `traces`: {name: {"evaluations": [{"prefill_replicas", "decode_replicas", "ttft_p99_ms",
  "itl_p99_ms"}], "slo": {...}}} (the tuner) -> p99 latency of every fleet size it tried.

Figures are drawn with matplotlib's object API on the Agg canvas: no pyplot, no global
backend switch, safe in a process that serves requests.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from tools.bench.load import timing_samples  # noqa: F401  (re-exported for callers)

_DPI = 110
_SIZE_KEY = re.compile(r"^gb_s_(\d+)mib$")
_BATCH_KEY = re.compile(r"^decode_tok_s_b(\d+)$")
_SPLIT_KEY = re.compile(r"^b(\d+)_ctx(\d+)$")


def write_plots(kind: str, result: dict[str, Any], directory: str | Path) -> list[Path]:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    samples = result.get("samples") or {}
    for key, title in (("ttft_ms", "time to first token"), ("itl_ms", "inter-token latency")):
        series = {label: s.get(key, []) for label, s in samples.items() if s.get(key)}
        if series:
            path = out / f"{kind}_{key.removesuffix('_ms')}_cdf.png"
            _save(_cdf(series, f"{kind}: {title} (CDF)", f"{title} (ms)"), path)
            written.append(path)
    sweep = _sweep(result)
    if sweep:
        path = out / f"{kind}_throughput_vs_concurrency.png"
        _save(_throughput(sweep, f"{kind}: throughput against concurrency"), path)
        written.append(path)
    histogram = _acceptance(result.get("acceptance_histogram"))
    if histogram:
        path = out / f"{kind}_acceptance_histogram.png"
        _save(_bars(histogram, f"{kind}: accepted draft tokens per step"), path)
        written.append(path)
    bandwidth = _bandwidth(result)
    if bandwidth:
        path = out / f"{kind}_transfer_bandwidth.png"
        _save(_bandwidth_figure(bandwidth, result.get("memcpy_gb_s"), kind), path)
        written.append(path)
    speedups = _split_speedups(result.get("split_kv_verify"))
    if speedups:
        path = out / f"{kind}_split_kv_verify_speedup.png"
        _save(_speedup_figure(speedups, kind), path)
        written.append(path)
    kernel_rates, limit = _kernel_rates(result)
    if kernel_rates:
        path = out / f"{kind}_kernel_bandwidth.png"
        _save(_rate_bars(kernel_rates, limit, f"{kind}: achieved GB/s per kernel"), path)
        written.append(path)
    for name, trace in (result.get("traces") or {}).items():
        points = _evaluations(trace)
        if points:
            path = out / f"{kind}_{_slug(name)}_fleet_sizes.png"
            _save(_fleet_figure(points, trace.get("slo") or {}, f"{kind}: {name}"), path)
            written.append(path)
    return written


# -- reading the result ------------------------------------------------------------------


def _sweep(result: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    lines: dict[str, list[tuple[float, float]]] = {}
    for point in result.get("sweep") or []:
        label = str(point.get("label", "throughput"))
        lines.setdefault(label, []).append(
            (float(point["concurrency"]), float(point["throughput_tok_s"]))
        )
    batches = [
        (float(m.group(1)), float(v))
        for k, v in result.items()
        if (m := _BATCH_KEY.match(k)) and isinstance(v, int | float)
    ]
    if batches:
        lines["engine decode"] = batches
    return {label: sorted(points) for label, points in lines.items()}


def _acceptance(raw: Any) -> dict[int, int]:
    if isinstance(raw, dict):
        return {int(k): int(v) for k, v in raw.items()}
    if isinstance(raw, list):
        return dict(Counter(int(x) for x in raw))
    return {}


def _bandwidth(result: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    lines = {}
    for name, figures in (result.get("backends") or {}).items():
        if not isinstance(figures, dict):
            continue
        points = [
            (int(m.group(1)), float(v))
            for k, v in figures.items()
            if (m := _SIZE_KEY.match(k)) and isinstance(v, int | float)
        ]
        if points:
            lines[name] = sorted(points)
    return lines


def _split_speedups(raw: Any) -> dict[str, list[tuple[int, float]]]:
    lines: dict[str, list[tuple[int, float]]] = {}
    for key, figures in (raw or {}).items():
        m = _SPLIT_KEY.match(str(key))
        if m and isinstance(figures, dict) and isinstance(figures.get("speedup"), int | float):
            lines.setdefault(f"batch {m.group(1)}", []).append(
                (int(m.group(2)), float(figures["speedup"]))
            )
    return {label: sorted(points) for label, points in lines.items()}


def _kernel_rates(result: dict[str, Any]) -> tuple[dict[str, float], float | None]:
    """Per-kernel GB/s and the limit they are read against (HBM spec, or this CPU's reads)."""
    if isinstance(result.get("kernels"), dict):
        figures, limit = result["kernels"], result.get("spec_hbm_gb_s")
    elif isinstance(result.get("cpu"), dict):
        figures, limit = result["cpu"].get("torch_reference") or {}, result["cpu"].get("read_gb_s")
    else:
        return {}, None
    rates = {
        label: float(f["gb_s"])
        for label, f in figures.items()
        if isinstance(f, dict) and isinstance(f.get("gb_s"), int | float)
    }
    return rates, float(limit) if isinstance(limit, int | float) else None


def _evaluations(trace: Any) -> list[tuple[int, float | None, float | None]]:
    if not isinstance(trace, dict):
        return []
    return [
        (
            int(e["prefill_replicas"]) + int(e["decode_replicas"]),
            e.get("ttft_p99_ms"),
            e.get("itl_p99_ms"),
        )
        for e in trace.get("evaluations") or []
        if isinstance(e, dict) and "prefill_replicas" in e and "decode_replicas" in e
    ]


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "trace"


# -- drawing ------------------------------------------------------------------------------


def _figure() -> tuple[Figure, Any]:
    fig = Figure(figsize=(7.0, 4.2), dpi=_DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig: Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path)


def _cdf(series: dict[str, list[float]], title: str, xlabel: str) -> Figure:
    fig, ax = _figure()
    for label, values in sorted(series.items()):
        if not values:
            continue
        xs = sorted(values)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        xs, ys = [xs[0], *xs], [0.0, *ys]  # rise from zero at the smallest sample
        ax.step(xs, ys, where="post", label=f"{label} (n={len(values)})")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of samples")
    ax.set_ylim(0, 1.02)
    filled = [v for v in series.values() if v]
    if filled and max(max(v) for v in filled) > 20 * max(min(v) for v in filled):
        ax.set_xscale("log")  # a long tail would squash the body of the distribution
    ax.legend()
    return fig


def _throughput(lines: dict[str, list[tuple[float, float]]], title: str) -> Figure:
    fig, ax = _figure()
    for label, points in sorted(lines.items()):
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.set_title(title)
    ax.set_xlabel("concurrent sequences")
    ax.set_ylabel("tokens / s")
    ax.set_xscale("log", base=2)
    ax.legend()
    return fig


def _bars(histogram: dict[int, int], title: str) -> Figure:
    fig, ax = _figure()
    keys = sorted(histogram)
    total = sum(histogram.values()) or 1
    ax.bar(keys, [histogram[k] / total for k in keys])
    ax.set_title(title)
    ax.set_xlabel("accepted draft tokens")
    ax.set_ylabel("fraction of verification steps")
    ax.set_xticks(keys)
    return fig


def _bandwidth_figure(
    lines: dict[str, list[tuple[int, float]]], memcpy: float | None, kind: str
) -> Figure:
    fig, ax = _figure()
    for name, points in sorted(lines.items()):
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    if memcpy:
        ax.axhline(memcpy, linestyle="--", color="gray", label=f"memcpy {memcpy:.1f} GB/s")
    ax.set_title(f"{kind}: transfer bandwidth against message size")
    ax.set_xlabel("message size (MiB)")
    ax.set_ylabel("GB/s")
    ax.set_xscale("log", base=2)
    ax.legend()
    return fig


def _speedup_figure(lines: dict[str, list[tuple[int, float]]], kind: str) -> Figure:
    fig, ax = _figure()
    for label, points in sorted(lines.items()):
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.axhline(1.0, linestyle="--", color="gray", label="unsplit kernel")
    ax.set_title(f"{kind}: split-KV verify speedup over the unsplit kernel")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("speedup (x)")
    ax.set_xscale("log", base=2)
    ax.legend()
    return fig


def _rate_bars(rates: dict[str, float], limit: float | None, title: str) -> Figure:
    fig, ax = _figure()
    labels = sorted(rates)
    ax.barh(labels, [rates[k] for k in labels])
    if limit:
        ax.axvline(limit, linestyle="--", color="gray", label=f"limit {limit:.0f} GB/s")
        ax.legend()
    ax.set_title(title)
    ax.set_xlabel("GB/s")
    return fig


def _fleet_figure(
    points: list[tuple[int, float | None, float | None]], slo: dict[str, Any], title: str
) -> Figure:
    fig, ax = _figure()
    for index, (metric, marker) in enumerate((("ttft_p99_ms", "o"), ("itl_p99_ms", "s"))):
        xs = [p[0] for p in points if p[1 + index] is not None]
        ys = [p[1 + index] for p in points if p[1 + index] is not None]
        if xs:
            line = ax.scatter(xs, ys, marker=marker, label=metric)
            target = slo.get(metric)
            if isinstance(target, int | float):
                ax.axhline(target, linestyle="--", color=line.get_facecolor()[0], alpha=0.7)
    ax.set_title(f"{title}: p99 latency of each fleet size tried (dashed: SLO)")
    ax.set_xlabel("replicas (prefill + decode)")
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.legend()
    return fig


def write_spec_plots(result: dict[str, Any], directory: str | Path) -> list[Path]:
    """`bench spec`: decode tok/s of every set/method/batch as bars, and the accepted-draft
    histogram of each speculating method (over both sets and batch sizes)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    rates = {
        f"{s}.{m}.{b}": float(fig["tok_s"])
        for s, methods in (result.get("sets") or {}).items()
        for m, batches in methods.items()
        for b, fig in batches.items()
    }
    written = []
    if rates:
        fig, ax = _figure()
        labels = sorted(rates)
        ax.barh(labels, [rates[k] for k in labels])
        ax.set_title("spec: decode tokens/s per prompt set, method and batch")
        ax.set_xlabel("tokens/s")
        path = out / "spec_tok_s.png"
        _save(fig, path)
        written.append(path)
    for method, hist in (result.get("acceptance_histograms") or {}).items():
        histogram = _acceptance(hist)
        if sum(histogram.values()):
            path = out / f"spec_{_slug(method)}_acceptance_histogram.png"
            _save(_bars(histogram, f"spec ({method}): accepted draft tokens per step"), path)
            written.append(path)
    return written
