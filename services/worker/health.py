"""A worker's grpc.health.v1 service: what Kubernetes probes and the local launcher waits for.

NOT_SERVING until the model is loaded *and* the coordinator accepted the registration (a
worker the router cannot see yet must not count as ready), SERVING while it takes requests,
NOT_SERVING for good once it drains. The overall status ("") and the Worker service's name
answer alike.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shared.proto_gen import worker_pb2

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
HEALTH_SERVICES = ("", WORKER_SERVICE)


class WorkerHealth:
    def __init__(self) -> None:
        self._servicer = health.aio.HealthServicer()

    async def add_to(self, server: grpc.aio.Server) -> None:
        """Register on `server` (before it starts), every service NOT_SERVING."""
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        for service in HEALTH_SERVICES:
            await self._servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def serve_plaintext(self, host: str, port: int) -> grpc.aio.Server:
        """This health service alone on a plaintext port, for probes that cannot speak TLS
        (the kubelet's gRPC probe): all it tells anyone is whether the worker serves."""
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        server.add_insecure_port(f"{host}:{port}")
        await server.start()
        return server

    async def serving(self) -> None:
        for service in HEALTH_SERVICES:
            await self._servicer.set(service, health_pb2.HealthCheckResponse.SERVING)

    async def draining(self) -> None:
        """NOT_SERVING from now on, whatever is set later."""
        await self._servicer.enter_graceful_shutdown()
