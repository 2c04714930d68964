"""The coordinator's admission queue: a per-model limit on requests in flight, tier-ordered.

A request takes a slot before its first backend call and gives it back when its response
ends. When the model is full, waiting requests are served by tier, then arrival; `default`
has no queue by default (429 + Retry-After at once), `flex` and `batch` wait in bounded
queues (`flex` only up to its max wait), and `priority` may use a few burst slots past the
limit and otherwise goes to the head of the line. Every refusal is a 429 in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field

from services.coordinator.errors import APIError
from services.coordinator.service_tiers import tier_priority
from shared.config.policy import ServiceTiersConfig

RATE_LIMIT_TYPE = "rate_limit_error"
# Before any request has finished there is no service time to go by.
_INITIAL_HOLD_S = 2.0
_EWMA = 0.2  # weight of the latest hold time in the running estimate


@dataclass(order=True)
class _Waiter:
    priority: int
    seq: int
    tier: str = field(compare=False)
    future: asyncio.Future = field(compare=False, repr=False)


class Ticket:
    """One admitted request's slot; `release()` is idempotent."""

    def __init__(self, queue: ModelQueue | None, tier: str):
        self._queue = queue
        self.tier = tier
        self.admitted_at = time.monotonic()
        self.waited_s = 0.0

    def release(self) -> None:
        if self._queue is not None:
            queue, self._queue = self._queue, None
            queue.release(time.monotonic() - self.admitted_at)


class ModelQueue:
    """Slots and waiters of one model."""

    def __init__(self, model_id: str, limit: int, tiers: ServiceTiersConfig):
        self.model_id = model_id
        self.limit = limit
        self.tiers = tiers
        self.in_flight = 0
        self._waiting: list[_Waiter] = []
        self._seq = itertools.count()
        self._hold_s = _INITIAL_HOLD_S

    def queued(self, tier: str | None = None) -> int:
        return sum(
            1 for w in self._waiting if not w.future.done() and (tier is None or w.tier == tier)
        )

    def _capacity(self, tier: str) -> int:
        return self.limit + self.tiers.policy(tier).burst

    def retry_after_s(self) -> float:
        """About when a slot frees up for someone now at the back of the line."""
        ahead = self.queued() + 1
        return max(1.0, self._hold_s * ahead / self.limit)

    def try_acquire(self, tier: str) -> Ticket | None:
        """A slot now, without waiting, if one is free for `tier` and nobody is ahead."""
        if self.in_flight < self._capacity(tier) and not self._ahead_of(tier):
            self.in_flight += 1
            return Ticket(self, tier)
        return None

    async def acquire(self, tier: str) -> Ticket:
        ticket = self.try_acquire(tier)
        if ticket is not None:
            return ticket
        policy = self.tiers.policy(tier)
        if self.queued(tier) >= policy.max_queue:
            raise self._rejection(tier, "the queue for this tier is full")
        loop = asyncio.get_running_loop()
        waiter = _Waiter(tier_priority(tier), next(self._seq), tier, loop.create_future())
        heapq.heappush(self._waiting, waiter)
        started = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), policy.max_wait_s)
        except TimeoutError:
            if not waiter.future.done():
                waiter.future.cancel()
                raise self._rejection(
                    tier, f"it waited {policy.max_wait_s:g} s, this tier's limit"
                ) from None
        except asyncio.CancelledError:
            # The client left. A slot granted in the same instant must not leak.
            if waiter.future.done() and not waiter.future.cancelled():
                self.release(0.0, record=False)
            else:
                waiter.future.cancel()
            raise
        ticket = Ticket(self, tier)
        ticket.waited_s = time.monotonic() - started
        return ticket

    def _ahead_of(self, tier: str) -> bool:
        """Whether someone already waiting should go before a newcomer of `tier`."""
        rank = tier_priority(tier)
        return any(not w.future.done() and w.priority <= rank for w in self._waiting)

    def release(self, held_s: float, record: bool = True) -> None:
        self.in_flight -= 1
        if record:
            self._hold_s += _EWMA * (held_s - self._hold_s)
        while self._waiting:
            head = self._waiting[0]
            if head.future.done():  # timed out or cancelled while waiting
                heapq.heappop(self._waiting)
                continue
            if self.in_flight >= self._capacity(head.tier):
                break
            heapq.heappop(self._waiting)
            self.in_flight += 1
            head.future.set_result(None)

    def _rejection(self, tier: str, why: str) -> APIError:
        seconds = math.ceil(self.retry_after_s())
        return APIError(
            429,
            f"Model '{self.model_id}' is at capacity for service_tier '{tier}' ({why}); "
            f"retry after {seconds} s or use a tier that may queue (flex, batch).",
            type=RATE_LIMIT_TYPE,
            code="rate_limit_exceeded",
            headers={"Retry-After": str(seconds)},
        )


class Admission:
    """Queues per model, created on first use; no limit configured = admit everything."""

    def __init__(self, tiers: ServiceTiersConfig):
        self.tiers = tiers
        self._queues: dict[str, ModelQueue] = {}

    def queue(self, model_id: str) -> ModelQueue | None:
        limit = self.tiers.limit(model_id)
        if limit is None:
            return None
        queue = self._queues.get(model_id)
        if queue is None:
            queue = self._queues[model_id] = ModelQueue(model_id, limit, self.tiers)
        return queue

    def try_acquire(self, model_id: str, tier: str) -> Ticket | None:
        """The common, uncontended case without an await; None = call `acquire` and wait."""
        queue = self.queue(model_id)
        if queue is None:
            return Ticket(None, tier)
        return queue.try_acquire(tier)

    async def acquire(self, model_id: str, tier: str) -> Ticket:
        queue = self.queue(model_id)
        if queue is None:
            return Ticket(None, tier)
        return await queue.acquire(tier)
