"""How the coordinator routes: the policy, the score's weights and the limits of its filter.

Kept in its own module so the router and the simulator can import it without the rest of
the deployment schema.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

RouterPolicyName = Literal["kv_aware", "least_loaded", "prefix_only", "round_robin"]


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: RouterPolicyName = "kv_aware"
    host_hit_cost: float = Field(
        0.2, ge=0.0, le=1.0, description="a host-tier block costs this fraction of recompute"
    )
    disk_hit_cost: float = Field(
        0.5, ge=0.0, le=1.0, description="a disk-tier block costs this fraction of recompute"
    )
    queue_weight: float = Field(
        1.0, ge=0.0, description="cost per prompt token already queued on a prefill replica"
    )
    in_flight_tokens: int = Field(
        128,
        ge=0,
        description="queued tokens assumed per request routed but not yet in a heartbeat",
    )
    decode_seq_tokens: int = Field(
        256, ge=0, description="a decode replica's load per running sequence, in KV tokens"
    )
    local_prefill_max_tokens: int = Field(
        256,
        ge=0,
        description="a decode replica holding the conversation prefills an uncached tail up "
        "to this long itself (no transfer); 0 disables conditional disaggregation",
    )
    local_prefill_min_cached: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="...and only when it holds at least this fraction of the prompt (a shared "
        "system prompt alone is not the conversation)",
    )
    max_queued_prefill_tokens: int | None = Field(
        None, ge=1, description="a prefill replica with more queued is skipped (None: no limit)"
    )
    max_waiting: int | None = Field(
        None, ge=1, description="a replica with more requests waiting is skipped (None: no limit)"
    )
