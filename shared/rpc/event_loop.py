"""The coordinator's event loop: uvloop where it is installed.

Why: every request crosses the coordinator's loop several times before its first token
leaves (HTTP body, the Prefill RPC, the relay of each message, the SSE writes), each hop a
few loop iterations. Measured on the ttft benchmark (2 cores, 30 fresh 300-token prompts,
interleaved runs), uvloop took the coordinator's share before the Prefill RPC from
1.29-1.44 to 1.17-1.30 ms p50; gRPC's asyncio stack runs on it unchanged. The workers keep
asyncio's loop: on them the same runs showed no difference within the noise, and their
loops sit beside the engine thread, not in front of it. `SPLITSERVE_UVLOOP=0` keeps
asyncio's own loop (as does a machine without the wheel, with a log line saying so).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

ENV = "SPLITSERVE_UVLOOP"


def loop_factory() -> tuple[Callable[[], asyncio.AbstractEventLoop] | None, str]:
    """(factory or None for asyncio's default, which loop and why) for this process."""
    if os.environ.get(ENV, "1") == "0":
        return None, f"asyncio's own event loop ({ENV}=0)"
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        return None, "asyncio's own event loop (uvloop is not installed)"
    return uvloop.new_event_loop, "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the chosen loop."""
    factory, which = loop_factory()
    log.info("event loop: %s", which)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
