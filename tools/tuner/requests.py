"""The simulator's per-request state: plain Python lists, because the event loop reads and
writes single elements millions of times and numpy scalar access is several times slower."""

from __future__ import annotations

import math

import numpy as np

from tools.tuner.trace import Trace

NOT_YET = math.nan


class RequestTable:
    def __init__(self, trace: Trace, priorities: np.ndarray):
        n = len(trace)
        self.n = n
        self.arrival: list[float] = trace.arrival_ms.tolist()
        self.input: list[int] = trace.input_tokens.tolist()
        self.output: list[int] = trace.output_tokens.tolist()
        self.priority: list[int] = priorities.tolist()
        self.hash_ids = trace.hash_ids
        self.block_tokens = trace.block_tokens
        # Filled in as the replay goes.
        self.cached: list[int] = [0] * n  # prefill skipped (a host hit only in part)
        self.hit: list[int] = [0] * n  # prompt tokens found in a cache, any tier
        self.prefill_replica: list[int] = [-1] * n
        self.decode_replica: list[int] = [-1] * n
        self.prefill_end: list[float] = [NOT_YET] * n
        # First token out: the prefill and the serving path (the KV moves after it).
        self.ttft: list[float] = [NOT_YET] * n
        self.finish: list[float] = [NOT_YET] * n
