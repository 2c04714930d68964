"""Physical limits of this machine, measured in the same run as the figures held against them."""

from __future__ import annotations

import time

import torch


def measure_read_bandwidth_gb_s(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best-of-N streaming read rate (a reduction over a buffer far larger than the caches)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def measure_matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """Best-of-N fp32 GEMM rate at the current torch thread count (what a prompt chunk's
    projections run as on a CPU)."""
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    a @ b  # warm: first call picks kernels and allocates
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best / 1e9
