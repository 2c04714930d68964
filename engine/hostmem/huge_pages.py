"""Large, long-lived host buffers (the KV pool, the native weights) on 2 MiB pages.

A decode step reads ~100 MB of weights and, at batch 8 and 512 tokens of context, ~94 MB of
fp16 K/V; on 4 KiB pages that is ~50,000 pages a step, far more than the TLB holds, so
every page costs a page walk. The kernel gives transparent huge pages to anonymous memory
marked MADV_HUGEPAGE (this machine's THP mode is `madvise`, the common default). Buffers
come from an anonymous mapping: zero-filled by the kernel and resident only as touched.
Where huge pages cannot be had (another OS, THP off) the buffer is still correct, on
ordinary pages.
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import torch

HUGE_PAGE = 2 * 1024**2
# Below this a buffer is not worth its own mapping (the TLB reach of a few pages).
MIN_BYTES = 8 * HUGE_PAGE


class _Mapping:
    """An anonymous mapping kept alive by the arrays that view it."""

    def __init__(self, nbytes: int):
        size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        # One huge page of slack: the mapping's start is only 4 KiB-aligned, and a 2 MiB
        # page needs a 2 MiB-aligned range.
        self.map = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = np.frombuffer(self.map, dtype=np.uint8)
        start = (-base.ctypes.data) % HUGE_PAGE
        self.huge = False
        # SPLITSERVE_HUGE_PAGES=0 keeps 4 KiB pages (to measure the difference, or where THP
        # misbehaves).
        if hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("SPLITSERVE_HUGE_PAGES") != "0":
            try:
                self.map.madvise(mmap.MADV_HUGEPAGE, start, size)
                self.huge = True
            except OSError:
                pass
        self.view = base[start : start + nbytes]


def empty_bytes(nbytes: int) -> np.ndarray:
    """A zero-filled uint8 buffer of `nbytes`, on huge pages when large and possible."""
    if nbytes < MIN_BYTES:
        return np.zeros(nbytes, dtype=np.uint8)
    return _Mapping(nbytes).view


def zeros_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU, on huge pages when large."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < MIN_BYTES:
        return torch.zeros(shape, dtype=dtype)
    raw = empty_bytes(nbytes)
    return torch.frombuffer(raw, dtype=dtype).view(shape)


def copy_array(array: np.ndarray) -> np.ndarray:
    """A contiguous copy of `array` on huge pages when large (weights packed once at load)."""
    if array.nbytes < MIN_BYTES:
        return np.ascontiguousarray(array)
    out = empty_bytes(array.nbytes).view(array.dtype).reshape(array.shape)
    out[...] = array
    return out
