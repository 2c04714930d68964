"""What the router knows about one replica when it routes: who it is, and its load as the
replica last reported it (the record its heartbeat carried, not a copy of its fields)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config.roles import WorkerRole, can_decode, can_prefill
from shared.wire.records import WorkerLoad


@dataclass(frozen=True)
class ReplicaState:
    worker_id: str
    role: WorkerRole
    model: str
    alive: bool = True
    in_flight: int = 0  # routed here by this coordinator, not yet finished
    load: WorkerLoad = WorkerLoad()  # last heartbeat

    @property
    def can_prefill(self) -> bool:
        return can_prefill(self.role)

    @property
    def can_decode(self) -> bool:
        return can_decode(self.role)
