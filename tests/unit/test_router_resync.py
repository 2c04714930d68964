"""The registry service's side of resync: a gap in a worker's KV events makes its heartbeat
ask for a snapshot, the snapshot restores its view, and a dead worker's events are ignored."""

from __future__ import annotations

import asyncio

from services.coordinator.route.registry import WorkerInfo, WorkerRegistry
from services.coordinator.route.registry_service import RegistryService
from shared.config.schema import parse_config
from shared.proto_gen import worker_pb2 as pb

MODEL = "SmolLM2-135M-Instruct"


def _service() -> RegistryService:
    registry = WorkerRegistry(parse_config({}), {MODEL: "fp"})
    registry.register(WorkerInfo("d0", "decode", MODEL, "a", "d0", 8192))
    return RegistryService(registry)


def _publish(service: RegistryService, *batches: pb.KVEventBatch) -> None:
    async def stream():
        for b in batches:
            yield b

    asyncio.run(service.PublishKVEvents(stream(), None))


def _batch(events: list[tuple[str, list[int], str, int]], snapshot: bool = False):
    return pb.KVEventBatch(
        worker_id="d0",
        snapshot=snapshot,
        events=[pb.KVEvent(kind=k, block_hashes=h, kv_tier=t, seq=s) for k, h, t, s in events],
    )


def _heartbeat(service: RegistryService, seq: int) -> pb.HeartbeatResponse:
    request = pb.HeartbeatRequest(worker_id="d0", load=pb.WorkerLoad(), kv_event_seq=seq)
    return asyncio.run(service.Heartbeat(request, None))


def test_gap_then_snapshot():
    service = _service()
    registry = service.registry
    _publish(service, _batch([("stored", [1, 2], "device", 1)]))
    assert _heartbeat(service, 1).resync_from_seq == 0
    _publish(service, _batch([("stored", [3], "device", 3)]))  # seq 2 never arrived
    assert registry.cached_prefix_blocks("d0", [1, 2]) == (0, None)  # stale: not trusted
    assert _heartbeat(service, 3).resync_from_seq == 2
    _publish(service, _batch([("stored", [1, 2, 3], "device", 3)], snapshot=True))
    assert _heartbeat(service, 3).resync_from_seq == 0
    assert registry.cached_prefix_blocks("d0", [1, 2, 3]) == (3, "device")


def test_events_lost_at_the_tail_are_caught_by_the_heartbeat():
    service = _service()
    _publish(service, _batch([("stored", [1], "device", 1)]))
    assert _heartbeat(service, 4).resync_from_seq == 2  # the worker got to 4; we have 1


def test_a_dead_workers_events_are_ignored():
    service = _service()
    service.registry.mark_dead("d0")
    _publish(service, _batch([("stored", [1], "device", 1)]))
    assert service.registry.kv.held("d0") == {}
