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
  bandwidth against message size, memcpy drawn as the limit.

Figures are drawn with matplotlib's object API on the Agg canvas: no pyplot, no global
backend switch, safe in a process that serves requests.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from services.bench.load import RequestTiming

_DPI = 110
_SIZE_KEY = re.compile(r"^gb_s_(\d+)mib$")
_BATCH_KEY = re.compile(r"^decode_tok_s_b(\d+)$")


def timing_samples(timings: Iterable[RequestTiming]) -> dict[str, list[float]]:
    """A `samples` entry from the load generator's per-request timings (errors left out)."""
    ok = [t for t in timings if t.error is None]
    return {
        "ttft_ms": [t.ttft_ms for t in ok if t.ttft_ms is not None],
        "itl_ms": [x for t in ok for x in t.itl_ms],
    }


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
        xs = sorted(values)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        xs, ys = [xs[0], *xs], [0.0, *ys]  # rise from zero at the smallest sample
        ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of samples")
    ax.set_ylim(0, 1.02)
    if max(max(v) for v in series.values()) > 20 * max(min(v) for v in series.values()):
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
