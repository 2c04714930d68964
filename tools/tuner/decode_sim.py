"""A decode replica in the simulator: continuous batching, one token per sequence per step.

Sequences join at a step boundary once their KV has arrived (and there is room in the
batch, higher tiers first) and leave after their last token. Between two such changes the
batch is fixed and each step costs a little more than the last (every context grows by one),
so a whole run of steps is one closed-form jump: the events are joins and leaves, not tokens.
Inter-token latencies are recorded per run, weighted by the tokens it produced.

The replica holds `kv_capacity` tokens of KV, as the engine's block pool does: a sequence
joins only when its whole context fits beside the batch's (higher tiers first, in order),
and when the batch's growth would overflow the pool the least important running sequence
(lowest tier, latest arrival) is preempted, as the engine's scheduler does in `recompute`
mode: it waits to rejoin, and rejoining recomputes its prompt and the tokens it had made
(`recompute_ms`), a stall every sequence in the batch waits through. Between two such
events the run is still closed form: the pool fills after a computable number of steps.

The replica also keeps the prompt blocks of what it served (`cache`), which is what the
router's conditional disaggregation looks at: a request whose prompt this replica mostly
holds skips the prefill pool and prefills its short tail here (`local_join`), a stall the
batch waits through like a recompute, its first token out at the stall's end.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

from services.planner.replica_profile import DecodeModel
from tools.tuner.prefix_cache import PrefixCache
from tools.tuner.requests import RequestTable
from tools.tuner.stepmath import run_ms, steps_to_reach

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
        "kv_capacity",
        "recompute_ms",
        "preemptions",
        "_leave_at",
        "_made",
        "_resumed_at",
        "_stall",
        "cache",
        "_local",
        "local_prefills",
    )

    def __init__(
        self,
        index: int,
        model: DecodeModel,
        max_batch: int,
        table: RequestTable,
        kv_capacity: int | None = None,
        recompute_ms: Callable[[int], float] | None = None,
        cache: PrefixCache | None = None,
    ):
        self.index = index
        self.model = model
        self.max_batch = max_batch
        self.table = table
        self.kv_capacity = kv_capacity  # None: unbounded
        self.recompute_ms = recompute_ms or (lambda tokens: 0.0)
        self.preemptions = 0
        self._leave_at: dict[int, int] = {}  # rid -> step_no after which it ends (running)
        self._made: dict[int, int] = {}  # preempted rid -> decode tokens it had made
        self._resumed_at: dict[int, float] = {}  # rejoined rid -> when its last token came out
        self._stall = 0.0  # recompute and local prefill time the next step waits for
        self.cache = cache  # prompt blocks of what it served; None: no local prefills
        self._local: dict[int, float] = {}  # rid -> its prefill here, ms, until it joins
        self.local_prefills = 0
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

    def local_join(self, rid: int, at: float, prefill_ms: float) -> None:
        """A request routed here to prefill its uncached tail itself (no prefill replica, no
        transfer): it joins at `at` and its prefill takes `prefill_ms` of this replica."""
        self._local[rid] = prefill_ms
        self.local_prefills += 1
        self.push_join(rid, at)

    def advance_to(self, t: float) -> None:
        """Every join and leave up to `t`; a run of steps is cut at the boundary before `t`."""
        if t < self._next_event:
            return
        model = self.model
        while True:
            if self.batch == 0:
                if self._stall:  # a one-token reply's local prefill: busy, nobody to step
                    self.clock += self._stall
                    self.busy_ms += self._stall
                    self._stall = 0.0
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
            leaves = self.leaves
            while self._leave_at.get(leaves[0][1]) != leaves[0][0]:
                heapq.heappop(leaves)  # a preempted sequence's old end
            k = leaves[0][0] - self.step_no
            if self.kv_capacity is not None and b > 1:
                room = (self.kv_capacity - self.context_sum) // b  # steps before the pool fills
                if room <= 0:
                    self._preempt()
                    continue
                k = min(k, room)
            first = model.step(b, self.context_sum)
            growth = model.step(b, self.context_sum + b) - first
            if self.joins and self.batch < self.max_batch:
                k = min(k, max(1, steps_to_reach(first, growth, self.joins[0][0] - self.clock)))
            dt = run_ms(k, first, growth) + self._stall
            if self.clock + dt > t:
                self._next_event = self.clock + dt
                return
            self._run(k, first, growth, dt)
            self._leave()
            self._admit()

    def _run(self, k: int, first: float, growth: float, dt: float) -> None:
        itl = self.itl
        table = self.table
        stall, self._stall = self._stall, 0.0
        mean = first + growth * (k - 1) * 0.5  # over all k steps
        later = first + growth * k * 0.5  # over steps 2..k
        newcomers = [0] * TIERS
        resumed = self._resumed_at
        for rid in self._new:  # the gap from its last token (or prefill's first) to this
            tier = table.priority[rid]
            since = resumed.pop(rid) if rid in resumed else table.ttft[rid]
            itl.add(self.clock + stall + first - since, 1, tier)
            newcomers[tier] += 1
        self._new = []
        for tier in range(TIERS):
            old = self.per_tier[tier] - newcomers[tier]
            if old and stall:  # the first step waited for a preempted sequence's recompute
                itl.add(first + stall, old, tier)
                if k > 1:
                    itl.add(later, old * (k - 1), tier)
            elif old:
                itl.add(mean, old * k, tier)
            if newcomers[tier] and k > 1:  # a newcomer's later tokens: steps 2..k
                itl.add(later, newcomers[tier] * (k - 1), tier)
        self.clock += dt
        self.busy_ms += dt
        self.step_no += k
        self.context_sum += self.batch * k
        self.tokens += self.batch * k

    def _context(self, rid: int) -> int:
        """A running sequence's KV: its prompt, the prefill's token, what it made here."""
        return self.table.input[rid] + 1 + self.step_no - self._joined_at[rid]

    def _remove(self, rid: int) -> None:
        self.context_sum -= self._context(rid)
        del self._joined_at[rid]
        del self._leave_at[rid]
        self.batch -= 1
        self.per_tier[self.table.priority[rid]] -= 1

    def _leave(self) -> None:
        leaves = self.leaves
        table = self.table
        while leaves and leaves[0][0] <= self.step_no:
            at, rid = heapq.heappop(leaves)
            if self._leave_at.get(rid) != at:  # preempted since: a stale entry
                continue
            table.finish[rid] = self.clock
            self.assigned -= 1
            self._remove(rid)

    def _preempt(self) -> None:
        """Free the least important running sequence's KV; it waits to rejoin."""
        table = self.table
        victim = max(self._joined_at, key=lambda r: (table.priority[r], table.arrival[r]))
        made = self.step_no - self._joined_at[victim]
        self._remove(victim)
        self._made[victim] = made
        if victim in self._new:  # joined at this boundary: no token since prefill's first
            self._new.remove(victim)
        else:
            self._resumed_at[victim] = self.clock
        self.preemptions += 1
        heapq.heappush(self.ready, (table.priority[victim], table.arrival[victim], victim))

    def _admit(self) -> None:
        joins, ready, table = self.joins, self.ready, self.table
        while joins and joins[0][0] <= self.clock:
            at, rid = heapq.heappop(joins)
            heapq.heappush(ready, (table.priority[rid], at, rid))
        capacity = self.kv_capacity
        while ready and self.batch < self.max_batch:
            rid = ready[0][2]
            made = self._made.get(rid, 0)
            need = table.input[rid] + 1 + made
            if capacity is not None and self.batch and self.context_sum + need > capacity:
                return  # in order: the next sequence waits for room
            heapq.heappop(ready)
            if rid in self._made:  # preempted: its KV is recomputed before the next step
                self._stall += self.recompute_ms(need)
                del self._made[rid]
            local = self._local.pop(rid, None)
            if local is not None:  # its prompt's tail prefills here; that makes the first
                self._stall += local
                table.ttft[rid] = self.clock + self._stall
                if table.output[rid] <= 1:  # ... and only token
                    table.finish[rid] = table.ttft[rid]
                    self.assigned -= 1
                    continue
            remaining = table.output[rid] - 1 - made  # the prefill (here or there) made one
            leave = self.step_no + remaining
            heapq.heappush(self.leaves, (leave, rid))
            self._leave_at[rid] = leave
            self._joined_at[rid] = self.step_no - made  # so _context counts what it made
            self.batch += 1
            self.per_tier[table.priority[rid]] += 1
            self.context_sum += need
            self._new.append(rid)
