"""What the router knows about one replica when it routes: who it is, and its load as the
replica last reported it (the record its heartbeat carried, not a copy of its fields)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.wire.records import WorkerLoad

Role = Literal["prefill", "decode", "both"]


@dataclass(frozen=True)
class ReplicaState:
    replica_id: str
    role: Role
    model: str
    alive: bool = True
    in_flight: int = 0  # routed here by this coordinator, not yet finished
    load: WorkerLoad = WorkerLoad()  # last heartbeat

    @property
    def can_prefill(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def can_decode(self) -> bool:
        return self.role in ("decode", "both")
