"""Migration and cancellation through the real gRPC path, in one process: worker runtimes
with the tiny random model behind grpc.aio servers, the coordinator's GrpcBackend in front.
A replica "dies" by having its server stopped mid-stream (its calls fail as on a crash)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import grpc
import pytest

from engine.model.tiny import tiny_checkpoint, write_hf_folder
from services.coordinator.attempt.grpc_backend import GrpcBackend
from services.coordinator.attempt.retry import RetryLoop
from services.coordinator.generation_backend import (
    BackendError,
    GenerationChunk,
    GenerationRequest,
    ModelInfo,
)
from services.coordinator.route.registry import WorkerInfo, WorkerRegistry
from services.coordinator.route.targets import RetryPolicy
from services.kvtransfer.control import add_control_servicer
from services.worker.decode import DecodeTransferControl
from services.worker.runtime import WorkerRuntime
from services.worker.server import WorkerServicer
from services.worker.telemetry import WorkerTelemetry
from shared.config.schema import DeploymentConfig, parse_config
from shared.proto_gen import worker_pb2 as pb
from shared.proto_gen import worker_pb2_grpc as pb_grpc
from shared.sampling.params import SamplingParams
from shared.wire.convert import params_to_proto

MODEL = "tiny"
PROMPT = [(i * 37 + 11) % 500 for i in range(40)]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-model")
    write_hf_folder(tiny_checkpoint(seed=0), folder)
    return str(folder)


def fleet_config(folder: str, pools: dict[str, int], **worker) -> DeploymentConfig:
    return parse_config(
        {
            "transfer": {"backend": "shm"},
            "models": [
                {
                    "id": MODEL,
                    "path": folder,
                    "weights": "fp32",
                    "pools": pools,
                    "worker": {
                        "kv_cache_bytes": 4 << 20,
                        "host_cache_bytes": 0,
                        "threads": 1,
                        **worker,
                    },
                }
            ],
        }
    )


@dataclass
class Replica:
    runtime: WorkerRuntime
    server: grpc.aio.Server
    control: DecodeTransferControl | None
    info: WorkerInfo
    servicer: WorkerServicer
    dead: bool = False

    async def kill(self) -> None:
        """Like a crash as far as callers can tell: every call fails, nothing drains."""
        self.dead = True
        await self.server.stop(grace=None)

    async def stats(self) -> dict:
        async with grpc.aio.insecure_channel(self.info.address) as channel:
            resp = await pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=5)
        return json.loads(resp.json)


@dataclass
class Fleet:
    config: DeploymentConfig
    registry: WorkerRegistry
    backend: GrpcBackend
    loop: RetryLoop  # what the HTTP layer serves a request with: migration lives here
    replicas: dict[str, Replica] = field(default_factory=dict)

    def role(self, role: str) -> list[Replica]:
        return [r for r in self.replicas.values() if r.info.role == role]

    async def close(self) -> None:
        await self.backend.close()
        for replica in self.replicas.values():
            if not replica.dead:
                await replica.server.stop(grace=None)
            if replica.control is not None:
                await replica.control.close()
            await replica.runtime.stop()


async def start_fleet(
    config: DeploymentConfig,
    tokenizer,
    *,
    max_migrations: int = 2,
    transfer_deadline_s: float = 5.0,
) -> Fleet:
    registry = WorkerRegistry(config, {})
    model = config.model(MODEL)
    info = ModelInfo(id=MODEL, context_length=1024, tokenizer=tokenizer)
    backend = GrpcBackend(registry, [info], transfer_deadline_s=transfer_deadline_s)
    policy = RetryPolicy([MODEL], max_migrations=max_migrations)
    fleet = Fleet(config, registry, backend, RetryLoop(backend, policy, tokenizer))
    for role in ("prefill", "decode", "both"):
        for index in range(getattr(model.pools, role)):
            runtime = WorkerRuntime(config, MODEL, role, index)
            telemetry = WorkerTelemetry.create(
                config,
                runtime.engine,
                worker_id=runtime.worker_id,
                role=role,
                model=MODEL,
                serve_http=False,
            )
            runtime.start()
            server = grpc.aio.server()
            control = DecodeTransferControl(runtime) if role != "prefill" else None
            servicer = WorkerServicer(runtime, telemetry, control)
            pb_grpc.add_WorkerServicer_to_server(servicer, server)
            if control is not None:
                add_control_servicer(server, control)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            worker = WorkerInfo(
                worker_id=runtime.worker_id,
                role=role,
                model=MODEL,
                address=f"127.0.0.1:{port}",
                transfer_agent=runtime.transfer.metadata.agent_name,
                max_model_len=runtime.engine.max_model_len,
            )
            registry.register(worker)
            fleet.replicas[worker.worker_id] = Replica(runtime, server, control, worker, servicer)
    return fleet


def request(rid: str, max_tokens: int, **params) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid,
        model=MODEL,
        prompt_token_ids=list(PROMPT),
        params=SamplingParams(temperature=0.0, max_tokens=max_tokens, **params),
        priority=1,
        service_tier="default",
    )


async def collect(loop: RetryLoop, req: GenerationRequest, on_chunk=None):
    chunks: list[GenerationChunk] = []
    async for chunk in loop.generate(req):
        chunks.append(chunk)
        if on_chunk is not None:
            await on_chunk(chunks)
    return chunks


def tokens(chunks: list[GenerationChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def migrations(chunk: GenerationChunk) -> list[tuple[dict, dict]]:
    """(the attempt that lost its replica, the migration that took over), from the metadata."""
    attempts = chunk.metadata["attempts"]
    return [
        (a, b) for a, b in zip(attempts, attempts[1:], strict=False) if b["reason"] == "migration"
    ]


def killer(fleet: Fleet, after_tokens: int, times: int = 1):
    """Kills the decode replica serving the stream once `after_tokens` more have arrived."""
    state = {"kills": 0, "mark": after_tokens}

    async def on_chunk(chunks: list[GenerationChunk]) -> None:
        if state["kills"] >= times or len(tokens(chunks)) < state["mark"]:
            return
        replica = fleet.replicas.get(chunks[-1].replica or "")
        if replica is None or replica.info.role != "decode" or replica.dead:
            return
        state["kills"] += 1
        state["mark"] = len(tokens(chunks)) + after_tokens
        await replica.kill()

    return on_chunk


def test_greedy_stream_survives_a_decode_death(tiny_folder, real_tokenizer):
    async def main():
        config = fleet_config(tiny_folder, {"prefill": 1, "decode": 2})
        fleet = await start_fleet(config, real_tokenizer)
        try:
            baseline = await collect(fleet.loop, request("base", 30))
            chunks = await collect(fleet.loop, request("moved", 30), killer(fleet, 8))
            return baseline, chunks, fleet
        finally:
            await fleet.close()

    baseline, chunks, fleet = asyncio.run(main())
    assert tokens(chunks) == tokens(baseline)
    last = chunks[-1]
    assert last.finished and last.finish_reason == "length"
    assert last.num_prompt_tokens == len(PROMPT)
    assert last.num_output_tokens == 30
    ((lost, moved),) = migrations(last)
    assert [a["reason"] for a in last.metadata["attempts"]] == ["first", "migration"]
    assert moved["after_tokens"] >= 8 and moved["success"] and not lost["success"]
    assert lost["replica"] != moved["replica"]
    dead = [r.info.worker_id for r in fleet.role("decode") if r.dead]
    assert dead and lost["replica"].endswith(dead[0]) and dead[0] not in moved["replica"]
    assert "UNAVAILABLE" in lost["error"] or "CANCELLED" in lost["error"]
    assert chunks[0].metadata["replica"].endswith(dead[0])  # the first chunk named the victim


def test_past_the_migration_limit_the_error_says_so(tiny_folder, real_tokenizer):
    async def main():
        config = fleet_config(tiny_folder, {"prefill": 1, "decode": 3})
        fleet = await start_fleet(config, real_tokenizer, max_migrations=1)
        try:
            with pytest.raises(BackendError) as err:
                await collect(fleet.loop, request("doomed", 40), killer(fleet, 5, times=2))
            return err.value, fleet
        finally:
            await fleet.close()

    error, fleet = asyncio.run(main())
    assert "migrated 1 times; giving up" in str(error)
    assert sum(r.dead for r in fleet.role("decode")) == 2


def test_no_pair_left_to_migrate_to_is_a_clear_error(tiny_folder, real_tokenizer):
    async def main():
        config = fleet_config(tiny_folder, {"prefill": 1, "decode": 1})
        fleet = await start_fleet(config, real_tokenizer)
        try:
            with pytest.raises(BackendError) as err:
                await collect(fleet.loop, request("orphan", 40), killer(fleet, 5))
            return err.value
        finally:
            await fleet.close()

    error = asyncio.run(main())
    assert "migrated 0 times; giving up" in str(error)
    assert "no healthy replica pair left" in str(error)


def test_decode_replica_prefills_locally_without_transfer(tiny_folder, real_tokenizer):
    """A (prefill=None) decision on a decode-role replica: one Decode call, kv_transferred
    unset; the reply equals the disaggregated one."""

    async def main():
        config = fleet_config(tiny_folder, {"prefill": 1, "decode": 1})
        fleet = await start_fleet(config, real_tokenizer)
        try:
            disaggregated = await collect(fleet.loop, request("pd", 12))
            (decode,) = fleet.role("decode")
            async with grpc.aio.insecure_channel(decode.info.address) as channel:
                generation = pb.Generation(
                    request_id="local",
                    model=MODEL,
                    prompt_token_ids=PROMPT,
                    sampling=params_to_proto(SamplingParams(temperature=0.0, max_tokens=12)),
                )
                call = pb_grpc.WorkerStub(channel).Decode(pb.DecodeRequest(generation=generation))
                msgs = [m async for m in call]
            return disaggregated, msgs
        finally:
            await fleet.close()

    disaggregated, msgs = asyncio.run(main())
    assert all(m.local_prefill for m in msgs)
    assert [t for m in msgs for t in m.token_ids] == tokens(disaggregated)
    assert msgs[-1].finished and msgs[-1].num_output_tokens == 12


def test_colocated_replica_serves_and_migrates(tiny_folder, real_tokenizer):
    async def main():
        config = fleet_config(tiny_folder, {"prefill": 0, "decode": 0, "both": 2})
        fleet = await start_fleet(config, real_tokenizer)
        try:
            baseline = await collect(fleet.loop, request("both", 20))

            async def kill_after_5(chunks):
                replica = fleet.replicas[chunks[-1].replica]
                if len(tokens(chunks)) >= 5 and not any(r.dead for r in fleet.replicas.values()):
                    await replica.kill()

            moved = await collect(fleet.loop, request("both-moved", 20), kill_after_5)
            return baseline, moved
        finally:
            await fleet.close()

    baseline, moved = asyncio.run(main())
    assert "->" not in baseline[0].metadata["replica"]  # one Decode call, local prefill
    assert tokens(moved) == tokens(baseline)
    assert len(migrations(moved[-1])) == 1


def test_routing_gets_the_conversation_and_the_failed_replicas(
    tiny_folder, real_tokenizer, monkeypatch
):
    import services.coordinator.attempt.grpc_backend as grpc_backend

    calls: list[dict] = []
    real_choose_pair = grpc_backend.choose_pair

    def recording(registry, model, **context):
        calls.append(context)
        return real_choose_pair(registry, model, **context)

    monkeypatch.setattr(grpc_backend, "choose_pair", recording)

    async def main():
        fleet = await start_fleet(
            fleet_config(tiny_folder, {"prefill": 1, "decode": 2}), real_tokenizer
        )
        try:
            turn1 = request("turn1", 6)
            turn1.user = "alice"
            first = await collect(fleet.loop, turn1)
            turn2 = request("turn2", 20)
            turn2.user = "alice"
            turn2.prompt_token_ids = PROMPT + tokens(first) + [5, 6, 7]
            await collect(fleet.loop, turn2, killer(fleet, 4))
            return first, fleet
        finally:
            await fleet.close()

    first, fleet = asyncio.run(main())
    served_turn1 = first[-1].replica
    assert calls[0]["previous_decode"] is None and calls[0]["exclude"] == frozenset()
    assert calls[1]["previous_decode"] == served_turn1  # the conversation's last decode
    assert calls[1]["prompt_token_ids"][: len(PROMPT)] == PROMPT
    (dead,) = [r.info.worker_id for r in fleet.role("decode") if r.dead]
    assert calls[2]["exclude"] == frozenset({dead})  # the migration routes around it
    assert len(calls[2]["prompt_token_ids"]) > len(calls[1]["prompt_token_ids"])


def test_prefill_death_before_the_first_token_moves_the_whole_request(tiny_folder, real_tokenizer):
    async def main():
        config = fleet_config(
            tiny_folder, {"prefill": 2, "decode": 1}, fault_injection={"first_token_delay_ms": 300}
        )
        fleet = await start_fleet(config, real_tokenizer)
        try:
            baseline = await collect(fleet.loop, request("whole", 10))
            task = asyncio.create_task(collect(fleet.loop, request("moved-early", 10)))
            await asyncio.sleep(0.1)  # inside the injected delay: no token yet
            (busy,) = [r for r in fleet.role("prefill") if r.info.in_flight]
            await busy.kill()
            return baseline, await task, busy.info.worker_id
        finally:
            await fleet.close()

    baseline, moved, victim = asyncio.run(main())
    assert tokens(moved) == tokens(baseline)
    ((lost, migration),) = migrations(moved[-1])
    assert migration["after_tokens"] == 0 and lost["error"].startswith(f"replica {victim} lost")
    assert lost["replica"] is None  # it died before its first chunk named the pair
    assert victim not in moved[0].metadata["replica"]  # the first chunk names the new pair
