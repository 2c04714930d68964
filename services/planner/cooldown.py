"""Cooldowns: a pool that just changed size keeps it for a while before changing again.

Scaling up waits `cooldown_s` after the pool's last change, scaling down the longer
`scale_down_cooldown_s` (new replicas take minutes to load a model; removing them on a
momentary dip only to add them back costs that twice). Moves back inside the bounds are
never held.
"""

from __future__ import annotations

from collections.abc import Mapping

from services.planner.decide import ROLES, Decision, Policy, PoolSizes


def apply_cooldown(
    decision: Decision,
    current: PoolSizes,
    last_change: Mapping[str, float],
    now: float,
    policy: Policy,
    cooldown_s: float,
    scale_down_cooldown_s: float,
) -> Decision:
    sizes = {role: decision.sizes.get(role) for role in ROLES}
    notes = []
    for role in ROLES:
        cur, want = current.get(role), sizes[role]
        lo, hi = policy.bounds(role)
        if want == cur or not lo <= cur <= hi or role not in last_change:
            continue
        wait = cooldown_s if want > cur else scale_down_cooldown_s
        since = now - last_change[role]
        if since < wait:
            sizes[role] = cur
            notes.append(f"{role} kept at {cur}: changed {since:.0f}s ago, cooldown {wait:.0f}s")
    if not notes:
        return decision
    return Decision(
        sizes["prefill"],
        sizes["decode"],
        f"{decision.reason}; " + "; ".join(notes),
        decision.signals,
    )
