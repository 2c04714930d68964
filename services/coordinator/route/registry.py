"""The coordinator's view of the fleet: who registered, their load, who is alive, and which
KV blocks each replica holds (fed by the workers' KV events)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from services.router.index import ApplyResult, KVIndex
from services.router.pipeline import RouterPipeline
from shared.config.roles import can_decode, can_prefill
from shared.config.schema import DeploymentConfig
from shared.kvblocks.events import KVEvent
from shared.wire.records import WorkerLoad

log = logging.getLogger(__name__)


@dataclass
class WorkerInfo:
    worker_id: str
    role: str
    model: str
    address: str
    transfer_agent: str
    max_model_len: int
    load: WorkerLoad = WorkerLoad()
    last_seen: float = field(default_factory=time.monotonic)
    alive: bool = True
    in_flight: int = 0  # requests this coordinator has routed there and not yet seen end
    kv_event_seq: int = 0
    metrics_address: str = ""  # host:port of its Prometheus /metrics; "" = not reported
    tokenizer_fingerprint: str = ""  # salts its block hashes; the router hashes prompts alike
    # The replica's name across restarts; worker_id names one process of it. "" = unnamed.
    replica: str = ""
    draining: bool = False  # shutting down: its running streams finish, nothing new comes

    @property
    def routable(self) -> bool:
        """May take new requests."""
        return self.alive and not self.draining

    @property
    def can_prefill(self) -> bool:
        return can_prefill(self.role)

    @property
    def can_decode(self) -> bool:
        return can_decode(self.role)


class RegistrationError(ValueError):
    pass


class WorkerRegistry:
    def __init__(self, config: DeploymentConfig, tokenizer_fingerprints: dict[str, str]):
        self.config = config
        self.fingerprints = tokenizer_fingerprints
        self.workers: dict[str, WorkerInfo] = {}
        # block hash -> {worker_id: tier}; what the KV-aware router scores prefixes with.
        self.kv = KVIndex()
        self.router = RouterPipeline(config.router, config.block_size)

    # -- membership ----------------------------------------------------------------------

    def check(self, model: str, fingerprint: str, block_size: int, role: str) -> None:
        """Refuse a worker that would disagree with the router; the message names what."""
        try:
            self.config.model(model)
        except KeyError:
            known = ", ".join(m.id for m in self.config.models)
            raise RegistrationError(
                f"model '{model}' is not in the coordinator's config ({known})"
            ) from None
        if block_size != self.config.block_size:
            raise RegistrationError(
                f"block_size {block_size} differs from the coordinator's {self.config.block_size}"
            )
        expected = self.fingerprints.get(model, "")
        if expected and fingerprint != expected:
            raise RegistrationError(
                f"tokenizer fingerprint {fingerprint[:12]}… differs from the coordinator's "
                f"{expected[:12]}… for model '{model}'"
            )
        if role not in ("prefill", "decode", "both"):
            raise RegistrationError(f"unknown role '{role}'")

    def register(self, info: WorkerInfo) -> None:
        """Add a replica; an earlier process of the same replica (a restart, maybe at a new
        address) is replaced, so it never stays beside the new one as a ghost."""
        for old in self.previous_processes(info):
            log.warning(
                "replica %s restarted: %s (at %s) replaces %s (at %s)",
                info.replica,
                info.worker_id,
                info.address,
                old.worker_id,
                old.address,
            )
            self.remove(old.worker_id)
        self.drop_kv(info.worker_id)
        self.workers[info.worker_id] = info

    def previous_processes(self, info: WorkerInfo) -> list[WorkerInfo]:
        if not info.replica:
            return []
        return [
            w
            for w in self.workers.values()
            if w.replica == info.replica and w.model == info.model and w.worker_id != info.worker_id
        ]

    def remove(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)
        self.drop_kv(worker_id)

    def heartbeat(self, worker_id: str, load: WorkerLoad, draining: bool = False) -> bool:
        info = self.workers.get(worker_id)
        if info is None or not info.alive:
            return False
        if draining:
            self.mark_draining(worker_id)
        info.draining = draining
        info.load = load
        info.last_seen = time.monotonic()
        return True

    def mark_draining(self, worker_id: str) -> None:
        """It said so (a heartbeat, or a stream it handed over): nothing new goes there."""
        info = self.workers.get(worker_id)
        if info is not None and not info.draining:
            info.draining = True
            log.info("replica %s is draining: no new requests go there", worker_id)

    def mark_dead(self, worker_id: str, reason: str = "") -> None:
        info = self.workers.get(worker_id)
        if info is not None and info.alive:
            info.alive = False
            # The one place a replica leaves the pool: say why, once.
            log.warning("replica %s left the pool: %s", worker_id, reason or "marked dead")
        self.drop_kv(worker_id)

    def reap(self, now: float | None = None) -> list[str]:
        """Workers silent for longer than the heartbeat timeout leave the pool."""
        now = time.monotonic() if now is None else now
        timeout = self.config.coordinator.heartbeat_timeout_s
        dead = [
            w.worker_id for w in self.workers.values() if w.alive and now - w.last_seen > timeout
        ]
        for worker_id in dead:
            self.mark_dead(worker_id, "missed heartbeats")
        return dead

    def routable(self, model: str) -> list[WorkerInfo]:
        """The replicas of `model` that may take new requests."""
        return [w for w in self.workers.values() if w.routable and w.model == model]

    # -- KV index ------------------------------------------------------------------------

    def apply_events(self, worker_id: str, events: list[KVEvent], snapshot: bool) -> ApplyResult:
        """One batch of a worker's KV events; `gap` in the result: it must send a snapshot."""
        result = self.kv.apply(worker_id, events, snapshot=snapshot)
        info = self.workers.get(worker_id)
        if info is not None:
            info.kv_event_seq = self.kv.last_seq(worker_id)
        return result

    def needs_resync(self, worker_id: str, published_seq: int) -> bool:
        """The worker published further than we applied (events lost in flight), or a gap
        made its view stale: either way only a snapshot puts it right."""
        return self.kv.is_stale(worker_id) or published_seq > self.kv.last_seq(worker_id)

    def drop_kv(self, worker_id: str) -> None:
        self.kv.drop(worker_id)

    def cached_prefix_blocks(
        self, worker_id: str, block_hashes: list[int]
    ) -> tuple[int, str | None]:
        """Leading blocks of a prompt this worker holds, and the slowest tier among them."""
        hit = self.kv.prefix(worker_id, block_hashes)
        worst = next((t for t in ("disk", "host", "device") if getattr(hit, t)), None)
        return hit.blocks, worst
