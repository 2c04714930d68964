"""What a worker replica serves: the prompt pass, the token loop, or both (colocated)."""

from __future__ import annotations

from typing import Literal

WorkerRole = Literal["prefill", "decode", "both"]
WORKER_ROLES: tuple[WorkerRole, ...] = ("prefill", "decode", "both")


def can_prefill(role: str) -> bool:
    return role in ("prefill", "both")


def can_decode(role: str) -> bool:
    return role in ("decode", "both")
