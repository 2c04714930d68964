"""What the router knows about one replica when it routes: a frozen snapshot of its load."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config.roles import WorkerRole, can_decode, can_prefill


@dataclass(frozen=True)
class ReplicaState:
    replica_id: str
    role: WorkerRole
    model: str
    alive: bool = True
    queued_prefill_tokens: int = 0  # prompt tokens waiting or mid-prefill (last heartbeat)
    active_kv_tokens: int = 0  # KV held by running sequences (last heartbeat)
    running: int = 0
    waiting: int = 0
    in_flight: int = 0  # routed here by this coordinator, not yet finished
    free_blocks: int = 0
    total_blocks: int = 0  # 0: the replica did not report its pool

    @property
    def can_prefill(self) -> bool:
        return can_prefill(self.role)

    @property
    def can_decode(self) -> bool:
        return can_decode(self.role)
