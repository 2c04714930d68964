"""Polling for a condition in tests that watch real processes."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], timeout_s: float = 10.0, interval_s=0.05) -> bool:
    """True as soon as `predicate()` is truthy; its last value's truth after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())
