"""A decode replica in the simulator: continuous batching, one token per sequence per step.

Sequences join at a step boundary once their KV has arrived (and there is room in the
batch, higher tiers first) and leave after their last token. Between two such changes the
batch is fixed and each step costs a little more than the last (every context grows by one),
so a whole run of steps is one closed-form jump: the events are joins and leaves, not tokens.
Inter-token latencies are recorded per run, weighted by the tokens it produced.
"""

from __future__ import annotations

import heapq
import math

from services.profiler.costmodel import DecodeModel
from services.tuner.requests import RequestTable
from services.tuner.stepmath import run_ms, steps_to_reach

TIERS = 4  # engine priorities 0..3
INF = math.inf


class ItlLog:
    """Inter-token gaps as (ms, how many tokens, tier) rows, kept as flat lists."""

    __slots__ = ("ms", "weight", "tier")

    def __init__(self) -> None:
        self.ms: list[float] = []
        self.weight: list[int] = []
        self.tier: list[int] = []

    def add(self, ms: float, weight: int, tier: int) -> None:
        self.ms.append(ms)
        self.weight.append(weight)
        self.tier.append(tier)


class DecodeReplica:
    __slots__ = (
        "index",
        "model",
        "max_batch",
        "table",
        "itl",
        "clock",
        "step_no",
        "batch",
        "context_sum",
        "per_tier",
        "leaves",
        "joins",
        "ready",
        "assigned",
        "_joined_at",
        "_new",
        "_next_event",
        "busy_ms",
        "tokens",
    )

    def __init__(self, index: int, model: DecodeModel, max_batch: int, table: RequestTable):
        self.index = index
        self.model = model
        self.max_batch = max_batch
        self.table = table
        self.itl = ItlLog()
        self.clock = 0.0  # the last step boundary reached
        self.step_no = 0  # steps taken so far
        self.batch = 0
        self.context_sum = 0  # tokens of context over the batch (what attention reads)
        self.per_tier = [0] * TIERS
        self.leaves: list[tuple[int, int]] = []  # heap of (step_no after which it ends, rid)
        self.joins: list[tuple[float, int]] = []  # heap of (KV arrived, rid)
        self.ready: list[tuple[int, float, int]] = []  # arrived, waiting for room
        self.assigned = 0  # routed here and not finished (as the coordinator counts)
        self._joined_at: dict[int, int] = {}
        self._new: list[int] = []  # joined at the last boundary, first token not out yet
        self._next_event = 0.0  # nothing changes before this time (cache for advance_to)
        self.busy_ms = 0.0
        self.tokens = 0

    def load(self) -> tuple[int, int]:
        return (self.assigned + self.batch, self.context_sum)

    def push_join(self, rid: int, at: float) -> None:
        heapq.heappush(self.joins, (at, rid))
        if at < self._next_event:
            self._next_event = at

    def advance_to(self, t: float) -> None:
        """Every join and leave up to `t`; a run of steps is cut at the boundary before `t`."""
        if t < self._next_event:
            return
        model = self.model
        while True:
            if self.batch == 0:
                if self.ready:
                    self._admit()
                    continue
                if not self.joins or self.joins[0][0] > t:
                    self._next_event = self.joins[0][0] if self.joins else INF
                    return
                self.clock = max(self.clock, self.joins[0][0])
                self._admit()
                continue
            b = self.batch
            first = model.step(b, self.context_sum)
            growth = model.step(b, self.context_sum + b) - first
            k_leave = self.leaves[0][0] - self.step_no
            k = k_leave
            if self.joins and self.batch < self.max_batch:
                k = min(k, max(1, steps_to_reach(first, growth, self.joins[0][0] - self.clock)))
            dt = run_ms(k, first, growth)
            if self.clock + dt > t:
                self._next_event = self.clock + dt
                return
            self._run(k, first, growth, dt)
            self._leave()
            self._admit()

    def _run(self, k: int, first: float, growth: float, dt: float) -> None:
        itl = self.itl
        table = self.table
        mean = first + growth * (k - 1) * 0.5  # over all k steps
        newcomers = [0] * TIERS
        for rid in self._new:  # the gap from the first token (streamed by prefill) to this
            tier = table.priority[rid]
            itl.add(self.clock + first - table.ttft[rid], 1, tier)
            newcomers[tier] += 1
        self._new = []
        for tier in range(TIERS):
            old = self.per_tier[tier] - newcomers[tier]
            if old:
                itl.add(mean, old * k, tier)
            if newcomers[tier] and k > 1:  # a newcomer's later tokens: steps 2..k
                itl.add(first + growth * k * 0.5, newcomers[tier] * (k - 1), tier)
        self.clock += dt
        self.busy_ms += dt
        self.step_no += k
        self.context_sum += self.batch * k
        self.tokens += self.batch * k

    def _leave(self) -> None:
        leaves = self.leaves
        table = self.table
        while leaves and leaves[0][0] == self.step_no:
            _, rid = heapq.heappop(leaves)
            table.finish[rid] = self.clock
            self.batch -= 1
            self.assigned -= 1
            self.per_tier[table.priority[rid]] -= 1
            self.context_sum -= table.input[rid] + 1 + self.step_no - self._joined_at.pop(rid)

    def _admit(self) -> None:
        joins, ready, table = self.joins, self.ready, self.table
        while joins and joins[0][0] <= self.clock:
            at, rid = heapq.heappop(joins)
            heapq.heappush(ready, (table.priority[rid], at, rid))
        while ready and self.batch < self.max_batch:
            _, _, rid = heapq.heappop(ready)
            remaining = table.output[rid] - 1  # the first token came from the prefill replica
            heapq.heappush(self.leaves, (self.step_no + remaining, rid))
            self._joined_at[rid] = self.step_no
            self.batch += 1
            self.per_tier[table.priority[rid]] += 1
            self.context_sum += table.input[rid] + 1
            self._new.append(rid)
