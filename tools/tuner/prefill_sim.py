"""A prefill replica in the simulator: the engine's chunked-prefill scheduler, step by step.

Each step spends a token budget on the sequences already started (in priority order), then
admits waiting ones in (priority, arrival) order, as `engine.core.scheduler` does; its time
comes from the profile's prefill model. While one long prompt has the budget to itself for
many steps nothing can change them, so those steps are taken in one jump (closed form).
A finished prompt's first token is streamed at once (the prefill service yields it the
moment it is sampled, before the KV moves), so TTFT is the prefill's end plus the serving
path; the KV is then pushed to its decode replica, which can only step the sequence once the
push has landed. A replica's pushes share its link: bytes go out one push after another at
the link's bandwidth (what concurrent pushes sharing it fairly add up to for the last of
them), each push's fixed latency beside.
"""

from __future__ import annotations

import heapq
from bisect import insort
from collections.abc import Callable

from services.planner.replica_profile import PrefillModel, TransferModel
from tools.tuner.prefix_cache import PrefixCache
from tools.tuner.requests import RequestTable
from tools.tuner.stepmath import run_ms, steps_within

# (request, first token out, its KV in place on the decode replica), in ms.
PrefilledFn = Callable[[int, float, float], None]


class PrefillReplica:
    __slots__ = (
        "index",
        "model",
        "chunk",
        "transfer",
        "overhead_ms",
        "kv_bytes_per_token",
        "table",
        "on_prefilled",
        "cache",
        "clock",
        "running",
        "waiting",
        "queued_tokens",
        "in_flight",
        "_pushing",
        "_link_free",
        "busy_ms",
        "served",
    )

    def __init__(
        self,
        index: int,
        model: PrefillModel,
        chunk: int,
        transfer: TransferModel,
        kv_bytes_per_token: int,
        table: RequestTable,
        cache: PrefixCache,
        on_prefilled: PrefilledFn,
        overhead_ms: float = 0.0,
    ):
        self.index = index
        self.model = model
        self.chunk = chunk
        self.transfer = transfer
        self.overhead_ms = overhead_ms
        self.kv_bytes_per_token = kv_bytes_per_token
        self.table = table
        self.cache = cache
        self.on_prefilled = on_prefilled
        self.clock = 0.0  # end of the last step taken: when the engine is next free
        self.running: list[list] = []  # [priority, arrival, rid, pending, offset], sorted
        self.waiting: list[tuple[int, float, int]] = []  # heap of (priority, arrival, rid)
        self.queued_tokens = 0  # prompt tokens not yet computed, running and waiting
        self.in_flight = 0  # routed here and first token not out yet (as the coordinator counts)
        self._pushing: list[float] = []  # heap: when each finished prompt's first token is out
        self._link_free = 0.0  # when the bytes of every push so far have left
        self.busy_ms = 0.0
        self.served = 0

    # -- what the router sees --------------------------------------------------------------

    def load(self, now: float) -> tuple[int, int]:
        pushing = self._pushing
        while pushing and pushing[0] <= now:
            heapq.heappop(pushing)
            self.in_flight -= 1
        return (self.in_flight, self.queued_tokens)

    # -- the replay ------------------------------------------------------------------------

    def add(self, rid: int, now: float) -> None:
        table = self.table
        heapq.heappush(self.waiting, (table.priority[rid], now, rid))
        self.queued_tokens += table.input[rid] - table.cached[rid]
        self.in_flight += 1
        self.served += 1
        if not self.running and len(self.waiting) == 1 and self.clock < now:
            self.clock = now  # idle until this arrival

    def advance_to(self, t: float) -> None:
        """Take every step that starts at or before `t` (a later arrival cannot change them)."""
        while (self.running or self.waiting) and self.clock <= t:
            running = self.running
            if len(running) == 1 and running[0][3] > 2 * self.chunk:
                self._jump(running[0], t)
            else:
                self._step()

    def _step(self) -> None:
        budget = self.chunk
        model = self.model
        tokens = 0
        attended = 0.0
        done = []
        for entry in self.running:
            if budget <= 0:
                break
            n = min(entry[3], budget)
            attended += n * (entry[4] + 0.5 * n)
            entry[3] -= n
            entry[4] += n
            tokens += n
            budget -= n
            if entry[3] == 0:
                done.append(entry)
        waiting = self.waiting
        table = self.table
        while budget > 0 and waiting:
            prio, arrival, rid = heapq.heappop(waiting)
            cached = table.cached[rid]
            pending = table.input[rid] - cached
            n = min(pending, budget)
            attended += n * (cached + 0.5 * n)
            tokens += n
            budget -= n
            entry = [prio, arrival, rid, pending - n, cached + n]
            insort(self.running, entry)
            if pending == n:
                done.append(entry)
        dt = model.step_ms + model.token_ms * tokens + model.attn_ms * attended
        self._advance_clock(dt, tokens)
        for entry in done:
            self.running.remove(entry)
            self._finish(entry[2])

    def _jump(self, entry: list, t: float) -> None:
        """Full-budget steps of a lone running prompt, all that start by `t` at once."""
        b = self.chunk
        model = self.model
        first = model.step_ms + model.token_ms * b + model.attn_ms * b * (entry[4] + 0.5 * b)
        growth = model.attn_ms * b * b
        k_max = (entry[3] - 1) // b  # leave the last chunk to a normal step (it admits others)
        # Steps starting at or before t: those whose predecessors end by t, plus one.
        k = min(k_max, steps_within(first, growth, t - self.clock) + 1)
        dt = run_ms(k, first, growth)
        entry[3] -= k * b
        entry[4] += k * b
        self._advance_clock(dt, k * b)

    def _advance_clock(self, dt: float, tokens: int) -> None:
        self.clock += dt
        self.busy_ms += dt
        self.queued_tokens -= tokens

    def _finish(self, rid: int) -> None:
        table = self.table
        end = self.clock
        table.prefill_end[rid] = end
        first_token = end + self.overhead_ms
        heapq.heappush(self._pushing, first_token)
        kv_ready = first_token
        if table.output[rid] > 1:  # a one-token reply is done: its KV goes nowhere
            transfer = self.transfer
            start = max(end, self._link_free)
            nbytes = table.input[rid] * self.kv_bytes_per_token
            self._link_free = start + nbytes / (transfer.gb_s * 1e6)
            kv_ready = self._link_free + transfer.latency_ms
        self.on_prefilled(rid, first_token, kv_ready)
