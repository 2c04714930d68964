"""One worker process: a grpc.aio server in the prefill, decode or both role."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict

import grpc

from engine.quality.require import QualityGateError
from services.kvtransfer.control import add_control_servicer
from services.worker.arrivals import Stage
from services.worker.decode import DecodeService, DecodeTransferControl
from services.worker.health import WorkerHealth
from services.worker.prefill import PrefillService
from services.worker.registration import RegistrationRefused
from services.worker.registrations import Registrations
from services.worker.runtime import WorkerRuntime
from services.worker.telemetry import WorkerTelemetry
from shared.config.roles import can_decode, can_prefill
from shared.config.schema import DeploymentConfig
from shared.proto_gen import worker_pb2 as pb
from shared.proto_gen import worker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
GIL_SWITCH_S = 0.0005

# On SIGTERM running streams get `worker_drain_grace_s` to finish; then the Decode streams
# still open are handed over (migrated by the coordinator), and whatever is still open (a
# hand-over message, a Prefill call's last message on its way out) gets DRAIN_TAIL_S. The
# chart's terminationGracePeriodSeconds leaves room for it (helm/splitserve/templates/_config.tpl).
DRAIN_TAIL_S = 2.0


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(
        self,
        runtime: WorkerRuntime,
        telemetry: WorkerTelemetry,
        control: DecodeTransferControl | None = None,
    ):
        self.runtime = runtime
        self.telemetry = telemetry
        self.control = control  # decode roles: the KV receives an Abort must stop too
        self.prefill_service = PrefillService(runtime) if can_prefill(runtime.role) else None
        self.decode_service = DecodeService(runtime) if can_decode(runtime.role) else None
        self.active_streams = 0  # Prefill and Decode calls still open: what a drain waits on

    async def Prefill(self, request, context):
        if self.prefill_service is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"{self.runtime.worker_id} has no prefill role"
            )
        with (
            self._stream(),
            self.telemetry.spans.prefill(request, context.invocation_metadata()) as trace,
        ):
            # aclosing: a call cancelled while a message is on its way closes the service's
            # generator now (it releases the request's blocks), not when it is collected.
            events = self.prefill_service.prefill(request, context)
            async with contextlib.aclosing(events):
                async for event in events:
                    if event.HasField("first_token"):
                        trace.record_first_token(event.first_token)
                    else:
                        trace.record_transfer(event.transfer)
                        if event.transfer.status not in ("", "skipped"):
                            self.telemetry.metrics.observe_push(
                                event.transfer.backend, event.transfer.status
                            )
                    yield event

    async def Decode(self, request, context):
        if self.decode_service is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"{self.runtime.worker_id} has no decode role"
            )
        with (
            self._stream(),
            self.telemetry.spans.decode(request, context.invocation_metadata()) as trace,
        ):
            async for chunk in self.decode_service.decode(request, context):
                trace.observe(chunk)
                yield chunk

    @contextlib.contextmanager
    def _stream(self) -> Iterator[None]:
        self.active_streams += 1
        try:
            yield
        finally:
            self.active_streams -= 1

    async def Abort(self, request, context):
        """The coordinator gave up on the request (client gone, migrated): stop it in every
        stage here — queued or running, KV parked, KV still arriving — and refuse late parts."""
        self.runtime.cancel(request.request_id)
        if self.control is not None:
            await self.control.cancel(request.request_id)
        return pb.AbortResponse(aborted=True)

    async def Stats(self, request, context):
        rt = self.runtime
        blocks = rt.engine.blocks
        stats = {
            "worker_id": rt.worker_id,
            "role": rt.role,
            "steps": rt.async_engine.steps,
            "aborted": rt.engine.num_aborted,
            "load": asdict(rt.engine.load()),
            "prefix_cache": vars(blocks.stats),
            "kv_tiers": rt.engine.kv_tiers(),
            "parked_kv": rt.arrivals.num_parked,
            "kv_receiving": rt.arrivals.count(Stage.RECEIVING),
            "speculative": rt.engine.spec_stats(),
            "structured": rt.engine.structured_stats(),
            "weights": rt.engine.weights_report(),
        }
        return pb.StatsResponse(json=json.dumps(stats, default=str))


async def serve_worker(
    config: DeploymentConfig, model_id: str, role: str, index: int, port: int = 0
) -> None:
    runtime = WorkerRuntime(config, model_id, role, index)
    telemetry = WorkerTelemetry.create(  # before the engine thread starts: it adds an observer
        config, runtime.engine, worker_id=runtime.worker_id, role=role, model=model_id
    )
    runtime.start()
    server = runtime.auth.server(options=[("grpc.so_reuseport", 0)])
    control = DecodeTransferControl(runtime) if can_decode(role) else None
    servicer = WorkerServicer(runtime, telemetry, control)
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    if control is not None:
        add_control_servicer(server, control)
    health = WorkerHealth()
    await health.add_to(server)
    port = runtime.auth.add_port(server, f"{config.worker_host}:{port}")
    await server.start()
    tls = config.internal_auth.tls
    probes = None
    if tls.enabled and tls.health_port is not None:
        probes = await health.serve_plaintext(config.worker_host, tls.health_port)
    address = f"{config.worker_host}:{port}"
    c = config.coordinator
    registry = Registrations(
        runtime, c.registries, address, telemetry.metrics_address, c.registry_resolve_interval_s
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = []
    try:
        await registry.start()
        await health.serving()
        log.info(
            "worker %s serving on %s (metrics on http://%s/metrics)",
            runtime.worker_id,
            address,
            telemetry.metrics_address,
        )
        tasks = [asyncio.create_task(runtime.expire_parked_forever())]
        await stop.wait()
        # Heartbeats go on while draining: the coordinator keeps the replica (its streams
        # are still running) but routes nothing new to it.
        await health.draining()
        await drain(servicer, registry.announce_draining, config.worker_drain_grace_s)
    finally:
        for t in tasks:
            t.cancel()
        await server.stop(grace=DRAIN_TAIL_S)
        if probes is not None:
            await probes.stop(grace=0)
        if control is not None:
            await control.close()
        if servicer.prefill_service is not None:
            await servicer.prefill_service.close()
        await registry.close()
        await runtime.stop()
        await asyncio.to_thread(telemetry.close)


async def drain(
    servicer: WorkerServicer,
    announce: Callable[[], Awaitable[None]],
    grace_s: float,
    tail_s: float = DRAIN_TAIL_S,
) -> None:
    """Stop being routed to (`announce` tells every coordinator), wait at most `grace_s` for
    the running streams to end, then hand the Decode streams still open over and wait at
    most `tail_s` for their last messages to leave.

    The server keeps accepting calls meanwhile: a request routed here just before the
    coordinator heard of the drain (its KV push, its Decode call) is served, or handed over
    once the grace is over.
    """
    await announce()
    deadline = time.monotonic() + grace_s
    log.info("draining: %d streams running, up to %.1f s", servicer.active_streams, grace_s)
    await _until_idle(servicer, deadline)
    if not servicer.active_streams:
        log.info("drained: every stream finished")
        return
    handed = 0
    if servicer.decode_service is not None:
        handed = servicer.decode_service.hand_over(
            f"replica draining: its {grace_s:g} s grace ran out"
        )
    log.warning(
        "drain grace over: %d streams running, %d Decode streams handed over",
        servicer.active_streams,
        handed,
    )
    await _until_idle(servicer, time.monotonic() + tail_s)
    if servicer.active_streams:
        log.warning("drain tail over: %d streams cut", servicer.active_streams)
    else:
        log.info("drained: every stream finished or was handed over")


async def _until_idle(servicer: WorkerServicer, deadline: float) -> None:
    while servicer.active_streams and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def run_worker(
    config: DeploymentConfig, model_id: str, role: str, index: int, port: int = 0
) -> None:
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {role}[{index}] %(levelname)s %(message)s"
    )
    # The engine thread runs Python between its native calls; with the default 5 ms GIL
    # switch interval the event loop (which streams each token) could wait that long for it.
    sys.setswitchinterval(GIL_SWITCH_S)
    try:
        asyncio.run(serve_worker(config, model_id, role, index, port))
    except RegistrationRefused as exc:
        log.error("registration refused: %s", exc)
        raise SystemExit(3) from exc
    except QualityGateError as exc:
        log.error("refusing to serve: %s", exc)
        raise SystemExit(4) from exc
    with contextlib.suppress(Exception):
        logging.shutdown()
