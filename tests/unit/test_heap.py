"""Freed heap pages go back to the system after a model is built (engine/model/heap.py)."""

from __future__ import annotations

import platform

import numpy as np
import pytest

from engine.model.heap import release_freed_memory


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(platform.system() != "Linux", reason="glibc's malloc_trim")
def test_freed_small_allocations_stop_being_resident():
    # Many small arrays come from the heap (not mmap), as a checkpoint's pieces do; one kept at
    # the end pins the heap's top, so freeing the rest alone returns nothing.
    arrays = [np.ones(16_000, dtype=np.float64) for _ in range(2_000)]  # ~250 MiB
    pin = np.ones(16_000, dtype=np.float64)
    before = _rss_mib()
    del arrays
    freed = _rss_mib()
    assert release_freed_memory()
    after = _rss_mib()
    assert before - freed < 50  # free() alone kept it resident
    assert before - after > 150, (before, freed, after)
    assert pin.sum() == 16_000
