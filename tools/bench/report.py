"""Writing a benchmark's JSON and printing its table, ours beside the limit or the peer."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path


def machine_info() -> dict:
    import torch

    return {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_json(path: str | None, data: dict) -> None:
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def save_outputs(kind: str, result: dict, json_path: str | None, plot_dir: str | None) -> None:
    """The JSON, and with `--plot DIR` the figures drawn from it (tools/bench/plots.py)."""
    write_json(json_path, result)
    if plot_dir:
        from tools.bench.plots import write_plots  # matplotlib: only when asked for

        for path in write_plots(kind, result, plot_dir):
            print(f"wrote {path}")


def print_table(title: str, rows: list[tuple[str, object, object, object]]) -> None:
    """rows: (metric, ours, reference, ratio) — reference is the peer or the physical limit."""
    print(f"\n{title}")
    print(f"{'metric':<34} {'ours':>12} {'limit/peer':>12} {'ratio':>8}")
    for name, ours, ref, ratio in rows:
        print(f"{name:<34} {_fmt(ours):>12} {_fmt(ref):>12} {_fmt(ratio):>8}")


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)
