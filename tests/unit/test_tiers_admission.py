"""The coordinator's admission queue: tier order under contention, bounded waits, 429s."""

from __future__ import annotations

import asyncio

import pytest

from services.coordinator.errors import APIError
from services.coordinator.route.admission import Admission, ModelQueue
from services.coordinator.settings import APISettings
from shared.config.policy import ServiceTierPolicy, ServiceTiersConfig
from tests.unit.coordinator_client import chat_body, run_with_client
from tests.unit.scripted_backend import Script, ScriptedTestBackend

MODEL = "m"


def _tiers(**overrides) -> ServiceTiersConfig:
    return ServiceTiersConfig(max_in_flight=1, **overrides)


def test_waiters_are_served_by_tier_then_arrival():
    async def main() -> list[str]:
        queue = ModelQueue(MODEL, 1, _tiers(priority=ServiceTierPolicy(max_queue=8)))
        holder = await queue.acquire("default")
        order: list[str] = []

        async def wait(label: str, tier: str) -> None:
            ticket = await queue.acquire(tier)
            order.append(label)
            await asyncio.sleep(0)
            ticket.release()

        arrivals = [("b1", "batch"), ("f1", "flex"), ("b2", "batch"), ("p1", "priority")]
        tasks = []
        for label, tier in arrivals + [("f2", "flex")]:
            tasks.append(asyncio.create_task(wait(label, tier)))
            await asyncio.sleep(0)  # arrive in this order
        assert queue.queued() == 5 and queue.in_flight == 1
        holder.release()
        await asyncio.gather(*tasks)
        assert queue.in_flight == 0
        return order

    assert asyncio.run(main()) == ["p1", "f1", "f2", "b1", "b2"]


def test_default_is_refused_at_once_with_retry_after():
    async def main() -> APIError:
        queue = ModelQueue(MODEL, 1, _tiers())
        await queue.acquire("batch")
        with pytest.raises(APIError) as info:
            await queue.acquire("default")
        return info.value

    error = asyncio.run(main())
    assert error.status == 429 and error.code == "rate_limit_exceeded"
    assert int(error.headers["Retry-After"]) >= 1
    assert "'default'" in error.message


def test_full_queue_and_flex_max_wait_are_429():
    async def main() -> tuple[APIError, APIError, int]:
        tiers = _tiers(
            flex=ServiceTierPolicy(max_queue=5, max_wait_s=0.05),
            batch=ServiceTierPolicy(max_queue=1),
        )
        queue = ModelQueue(MODEL, 1, tiers)
        await queue.acquire("default")
        waiting = asyncio.create_task(queue.acquire("batch"))
        await asyncio.sleep(0)
        with pytest.raises(APIError) as full:
            await queue.acquire("batch")
        with pytest.raises(APIError) as waited:
            await queue.acquire("flex")
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        return full.value, waited.value, queue.queued()

    full, waited, left = asyncio.run(main())
    assert full.status == 429 and "queue for this tier is full" in full.message
    assert waited.status == 429 and "waited 0.05 s" in waited.message
    assert left == 0


def test_priority_bursts_past_the_limit_and_cancelled_waiters_leak_nothing():
    async def main() -> tuple[int, int]:
        queue = ModelQueue(MODEL, 1, _tiers(priority=ServiceTierPolicy(max_queue=4, burst=1)))
        first = await queue.acquire("batch")
        urgent = queue.try_acquire("priority")  # the burst slot, no waiting
        assert urgent is not None and queue.in_flight == 2
        waiter = asyncio.create_task(queue.acquire("batch"))
        await asyncio.sleep(0)
        waiter.cancel()  # the client left while queued
        await asyncio.gather(waiter, return_exceptions=True)
        first.release()
        urgent.release()
        urgent.release()  # idempotent
        return queue.in_flight, queue.queued()

    assert asyncio.run(main()) == (0, 0)


def test_no_limit_admits_everything():
    admission = Admission(ServiceTiersConfig())
    tickets = [admission.try_acquire(MODEL, "default") for _ in range(100)]
    assert all(t is not None for t in tickets)


def test_overload_over_http_is_429_with_retry_after_and_queued_tiers_wait(real_tokenizer):
    backend = ScriptedTestBackend(real_tokenizer, {MODEL: Script(first_token_delay_s=0.3)})
    settings = APISettings(model_id=MODEL, tiers=_tiers(batch=ServiceTierPolicy(max_queue=4)))

    async def work(client):
        async def post(tier: str):
            return await client.post("/v1/chat/completions", json=chat_body(service_tier=tier))

        running = asyncio.create_task(post("batch"))
        await asyncio.sleep(0.1)
        queued = asyncio.create_task(post("batch"))
        await asyncio.sleep(0.05)
        refused = await post("default")
        return refused, await running, await queued

    refused, running, queued = run_with_client(backend, settings, work)
    assert refused.status_code == 429
    assert int(refused.headers["retry-after"]) >= 1
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
    assert running.status_code == queued.status_code == 200
    assert queued.json()["service_tier"] == "batch"


def test_time_in_the_tier_queue_is_a_span_of_the_request(real_tokenizer):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from shared.telemetry import attributes as A
    from shared.telemetry.tracing import Tracing

    exporter = InMemorySpanExporter()
    tracing = Tracing.with_exporter(exporter, "splitserve-coordinator")
    backend = ScriptedTestBackend(real_tokenizer, {MODEL: Script(first_token_delay_s=0.2)})
    settings = APISettings(model_id=MODEL, tiers=_tiers(batch=ServiceTierPolicy(max_queue=4)))

    async def work(client):
        body = chat_body(service_tier="batch")
        first = asyncio.create_task(client.post("/v1/chat/completions", json=body))
        await asyncio.sleep(0.05)
        second = await client.post("/v1/chat/completions", json=body)
        return await first, second

    first, second = run_with_client(backend, settings, work, tracing)
    assert first.status_code == second.status_code == 200
    tracing.force_flush()
    spans = exporter.get_finished_spans()
    # Only the request that found the model full waited: one queue span, in its trace.
    (queued,) = [s for s in spans if s.name == A.SPAN_COORDINATOR_QUEUE]
    assert queued.attributes[A.TIER] == "batch"
    parent = next(s for s in spans if s.context.span_id == queued.parent.span_id)
    assert parent.context.trace_id == queued.context.trace_id and parent.parent is None
    assert parent.context.trace_id == int(second.headers["x-trace-id"], 16)
