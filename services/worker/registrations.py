"""A worker registered with every coordinator: one RegistryClient per coordinator address.

The engine's KV events are taken off its queue once and handed to every client, each of
which publishes them with its own heartbeats, so a slow or dead coordinator never holds up
the others (nor their heartbeats, which keep the worker in their pools). Addresses come from
the registry endpoints, looked up again every `resolve_interval_s`
(services/worker/coordinators.py says why workers push to coordinators): a coordinator that
appears is registered with (and sent a snapshot), one that disappears is let go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import time
from collections.abc import Sequence

from services.worker.coordinators import resolve_registries
from services.worker.registration import RegistrationRefused, RegistryClient
from services.worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)

# How long a worker waits for the first coordinator to accept it before giving up.
FIRST_REGISTRATION_TIMEOUT_S = 180.0
# While no endpoint resolves (the coordinators are not scheduled yet), look again this often.
UNRESOLVED_RETRY_S = 1.0


class Registrations:
    def __init__(
        self,
        runtime: WorkerRuntime,
        endpoints: Sequence[str],
        worker_address: str,
        metrics_address: str = "",
        resolve_interval_s: float = 5.0,
    ):
        self.runtime = runtime
        self.endpoints = tuple(endpoints)
        self.worker_address = worker_address
        self.metrics_address = metrics_address
        self.resolve_interval_s = resolve_interval_s
        self.clients: dict[str, RegistryClient] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._resolver: asyncio.Task | None = None
        self.draining = False
        self.refusal: RegistrationRefused | None = None  # the first coordinator's "no"

    def pump(self) -> None:
        """The engine's new KV events, to every client registered with its coordinator (one
        that is not gets a full snapshot when it registers, so it needs none of them)."""
        events = []
        while True:
            try:
                events.append(self.runtime.kv_events.get_nowait())
            except queue.Empty:
                break
        if events:
            for client in self.clients.values():
                if client.registered:
                    client.pending.extend(events)

    async def start(self, timeout_s: float = FIRST_REGISTRATION_TIMEOUT_S) -> None:
        """Return once one coordinator accepted us; the others register in the background.

        A refusal is final (every coordinator reads the same config, so the others would
        refuse too): RegistrationRefused, with the coordinator's reason.
        """
        deadline = time.monotonic() + timeout_s
        looked_up = 0.0
        while not any(c.registered for c in self.clients.values()):
            if self.refusal is not None:
                raise self.refusal
            if time.monotonic() > deadline:
                tried = (
                    ", ".join(self.clients) or f"nothing: {', '.join(self.endpoints)} unresolved"
                )
                raise RegistrationRefused(f"no coordinator's registry answered (tried {tried})")
            if not self.clients and time.monotonic() - looked_up > UNRESOLVED_RETRY_S:
                looked_up = time.monotonic()
                self._follow(await resolve_registries(self.endpoints))
            await asyncio.sleep(0.05)
        self._resolver = asyncio.create_task(self._resolve_forever())

    async def _resolve_forever(self) -> None:
        while True:
            await asyncio.sleep(self.resolve_interval_s)
            addresses = await resolve_registries(self.endpoints)
            if addresses:  # a failed lookup is no reason to leave every coordinator
                self._follow(addresses)

    def _follow(self, addresses: list[str]) -> None:
        for address in addresses:
            if address not in self.clients:
                self._add(address)
        for address in [a for a in self.clients if a not in addresses]:
            log.info("coordinator at %s is gone from the registry endpoints", address)
            self._tasks.pop(address).cancel()
            client = self.clients.pop(address)
            asyncio.create_task(client.close())

    def _add(self, address: str) -> None:
        client = RegistryClient(
            self.runtime, address, self.worker_address, self.metrics_address, pump=self.pump
        )
        client.draining = self.draining
        self.clients[address] = client
        self._tasks[address] = asyncio.create_task(self._serve(client))

    async def _serve(self, client: RegistryClient) -> None:
        try:
            await client.register(attempts=None)
            await client.heartbeat_forever()
        except RegistrationRefused as exc:
            log.error("the coordinator at %s refused us: %s", client.registry_address, exc)
            self.refusal = self.refusal or exc

    async def announce_draining(self) -> None:
        """Every coordinator at once: route nothing new here."""
        self.draining = True
        await asyncio.gather(*(c.announce_draining() for c in self.clients.values()))

    async def close(self) -> None:
        tasks = [*self._tasks.values(), *([self._resolver] if self._resolver else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        await asyncio.gather(*(c.close() for c in self.clients.values()))
