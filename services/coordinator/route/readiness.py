"""Whether the coordinator can serve: `/ready`'s answer, from the registry.

Ready means every served model has at least one routable path — a prefill and a decode
replica, or one replica doing both — not that every configured replica is up: one crashed
worker out of several must not take the API out of a Kubernetes Service while the others
serve. When not ready, the answer lists what is missing, per model and role.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from services.coordinator.route.registry import WorkerRegistry
from shared.config.roles import WORKER_ROLES


def missing_roles(routable: Counter[str]) -> list[str]:
    """The roles a model lacks for a path, given its routable replicas per role."""
    if routable["both"]:
        return []
    return [role for role in ("prefill", "decode") if not routable[role]]


def fleet_readiness(registry: WorkerRegistry) -> dict[str, Any]:
    models: dict[str, Any] = {}
    missing: list[dict[str, str]] = []
    for model in registry.config.models:
        routable = Counter(w.role for w in registry.routable(model.id))
        configured = {role: getattr(model.pools, role) for role in WORKER_ROLES}
        lacking = missing_roles(routable)
        for role in lacking:
            missing.append(
                {
                    "model": model.id,
                    "role": role,
                    "message": f"no routable {role} replica and no 'both' replica "
                    f"({configured[role]} {role} configured)",
                }
            )
        models[model.id] = {
            "routable": not lacking,
            "replicas": {role: routable[role] for role in WORKER_ROLES},
            "configured": configured,
        }
    return {"ready": not missing, "missing": missing, "models": models}
