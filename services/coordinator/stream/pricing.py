"""What one response cost, from its usage and the tier's prices (USD per million tokens)."""

from __future__ import annotations

from typing import Any

from shared.config.policy import Price

_PER = 1_000_000
_DIGITS = 10  # sub-micro-dollar amounts stay visible for one short request


def response_cost(usage: dict[str, Any], tier: str, price: Price) -> dict[str, Any]:
    """`metadata.cost`: cached prompt tokens at the cached rate, the rest at the input rate."""
    prompt = usage["prompt_tokens"]
    cached = min(usage["prompt_tokens_details"]["cached_tokens"], prompt)
    output = usage["completion_tokens"]
    input_usd = (prompt - cached) * price.input / _PER
    cached_usd = cached * price.cached_input / _PER
    output_usd = output * price.output / _PER
    return {
        "input_usd": round(input_usd, _DIGITS),
        "cached_input_usd": round(cached_usd, _DIGITS),
        "output_usd": round(output_usd, _DIGITS),
        "total_usd": round(input_usd + cached_usd + output_usd, _DIGITS),
        "tier": tier,
    }
