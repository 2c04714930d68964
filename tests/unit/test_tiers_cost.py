"""`metadata.cost`: what one response cost at its tier's prices, cached tokens included."""

from __future__ import annotations

import pytest

from services.coordinator.settings import APISettings
from services.coordinator.stream.pricing import response_cost
from shared.config.policy import Price
from tests.unit.coordinator_client import chat_body, meta, run_with_client, sse_events
from tests.unit.scripted_backend import Script, ScriptedTestBackend

MODEL = "m"
PRICES = {
    "default": Price(input=2.0, cached_input=0.5, output=8.0),
    "batch": Price(input=1.0, cached_input=0.25, output=4.0),
}


def _usage(prompt: int, cached: int, output: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def test_cost_splits_cached_from_fresh_input():
    cost = response_cost(_usage(1000, 400, 50), "default", PRICES["default"])
    assert cost == {
        "input_usd": pytest.approx(600 * 2.0 / 1e6),
        "cached_input_usd": pytest.approx(400 * 0.5 / 1e6),
        "output_usd": pytest.approx(50 * 8.0 / 1e6),
        "total_usd": pytest.approx((1200 + 200 + 400) / 1e6),
        "tier": "default",
    }


def _served(tokenizer, body):
    backend = ScriptedTestBackend(tokenizer, {MODEL: Script(num_tokens=3, cached_tokens=4)})
    settings = APISettings(model_id=MODEL, prices=PRICES)

    async def work(client):
        return await client.post("/v1/chat/completions", json=body)

    return run_with_client(backend, settings, work)


@pytest.mark.parametrize("tier", ["default", "batch"])
def test_every_response_has_its_cost(real_tokenizer, tier):
    data = _served(real_tokenizer, chat_body(service_tier=tier)).json()
    usage = data["usage"]
    expected = response_cost(usage, tier, PRICES[tier])
    assert meta(data, "cost") == expected
    assert usage["prompt_tokens_details"]["cached_tokens"] == 4
    assert expected["cached_input_usd"] == pytest.approx(4 * PRICES[tier].cached_input / 1e6)
    assert expected["output_usd"] == pytest.approx(3 * PRICES[tier].output / 1e6)


def test_unpriced_tiers_keep_the_default_table(real_tokenizer):
    data = _served(real_tokenizer, chat_body(service_tier="priority")).json()
    assert meta(data, "cost")["total_usd"] > 0


def test_streaming_cost_is_on_the_last_chunk_and_the_usage_chunk(real_tokenizer):
    body = chat_body(stream=True, stream_options={"include_usage": True})
    events = sse_events(_served(real_tokenizer, body).text)
    usage_chunk = events[-1]
    last_choice = [e for e in events if e["choices"]][-1]
    assert meta(usage_chunk, "cost") == response_cost(
        usage_chunk["usage"], "default", PRICES["default"]
    )
    assert meta(last_choice, "cost") == meta(usage_chunk, "cost")
    assert "cost" not in events[0]["metadata"]  # not final yet on the opening chunk
