"""OpenAI `service_tier` values and the scheduling priority each one maps to."""

from __future__ import annotations

# Smaller runs first; the engine's schedulers and preemption order follow it.
TIER_PRIORITY: dict[str, int] = {"priority": 0, "default": 1, "flex": 2, "batch": 3}
VALID_TIERS: tuple[str, ...] = ("auto", "default", "priority", "flex", "batch")
# The tiers a request is actually served at (`auto` resolves to one of them).
SERVED_TIERS: tuple[str, ...] = ("priority", "default", "flex", "batch")


def resolve_tier(requested: str | None) -> str:
    """The tier a request is served at: `auto` (and no tier) means `default`, as at OpenAI.

    The caller has already checked that `requested` is one of VALID_TIERS.
    """
    if requested is None or requested == "auto":
        return "default"
    return requested


def tier_priority(tier: str) -> int:
    return TIER_PRIORITY[tier]
