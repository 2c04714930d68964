"""Fault injection for tests: knobs that make a healthy replica misbehave on purpose.

Everything here is off by default and exists only so tests can exercise the coordinator's
reactions (fallback on a missed TTFT deadline, migration) against real worker processes. A
production config never sets these; the worker logs a warning at start when one is on.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class FaultInjection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    first_token_delay_ms: int = Field(
        0,
        ge=0,
        description="TEST ONLY: hold every request this long before its first token is computed",
    )

    kv_push_hold_ms: int = Field(
        0,
        ge=0,
        description="TEST ONLY: hold every KV push this long once the decode replica has "
        "reserved its blocks, before any byte moves (a window to kill a transfer's receiver)",
    )

    @property
    def active(self) -> bool:
        return self.first_token_delay_ms > 0 or self.kv_push_hold_ms > 0

    @property
    def first_token_delay_s(self) -> float:
        return self.first_token_delay_ms / 1e3
