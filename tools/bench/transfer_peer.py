"""A transfer agent in its own OS process, driven over a pipe.

The cross-process tests and the bench use it to put the prefill and the decode side in two
real processes (multiprocessing ``spawn``), the way replicas run. Commands and replies are
JSON; agent metadata travels as its protobuf encoding, as it would over the control plane.
The child wraps every transfer in a ``TransferSession`` and records each release callback,
so a test can check that both sides gave their blocks back exactly once.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from engine.kvcache.pool import KVLayout
from services.kvtransfer.blockbytes import byte_view
from services.kvtransfer.codec import metadata_from_proto, metadata_to_proto
from services.kvtransfer.factory import create_pool, create_transfer_backend
from services.kvtransfer.session import TransferSession
from services.kvtransfer.shm_pool import SHM_DIR, SharedKVPool
from services.kvtransfer.types import (
    AgentMetadata,
    BlockDescriptor,
    ReceiveDescriptors,
    dtype_from_name,
    dtype_name,
)
from shared.proto_gen import kvtransfer_pb2 as pb


@contextlib.contextmanager
def alarm_after(seconds: int) -> Iterator[None]:
    """Raises TimeoutError in the main thread after ``seconds``: a backstop so that a test
    that would hang fails instead (every wait in kvtransfer is bounded by a deadline too)."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"gave up after {seconds}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


class PeerError(RuntimeError):
    """The command raised in the child; the message carries the child's exception."""


@dataclass(frozen=True)
class PeerPlan:
    backend: str
    agent_name: str
    layout: KVLayout
    num_blocks: int
    fence_grace_s: float = 2.0
    options: dict[str, Any] = field(default_factory=dict)  # backend constructor options

    def to_json(self) -> str:
        layout = {**self.layout.__dict__, "dtype": dtype_name(self.layout.dtype)}
        return json.dumps({**self.__dict__, "layout": layout})


def encode_metadata(md: AgentMetadata) -> str:
    return base64.b64encode(metadata_to_proto(md).SerializeToString()).decode()


def decode_metadata(text: str) -> AgentMetadata:
    return metadata_from_proto(pb.AgentMetadata.FromString(base64.b64decode(text)))


def _descriptors_to_json(d: ReceiveDescriptors) -> dict[str, Any]:
    blocks = [[b.block_id, b.addr, b.nbytes] for b in d.blocks]
    return {"request_id": d.request_id, "agent_name": d.agent_name, "blocks": blocks}


def _descriptors_from_json(d: dict[str, Any]) -> ReceiveDescriptors:
    blocks = tuple(BlockDescriptor(*b) for b in d["blocks"])
    return ReceiveDescriptors(d["request_id"], d["agent_name"], blocks)


class _Agent:
    """The child's side: one backend, one pool, one session per request."""

    def __init__(self, plan: dict[str, Any]):
        layout = KVLayout(**{**plan["layout"], "dtype": dtype_from_name(plan["layout"]["dtype"])})
        self.backend = create_transfer_backend(
            plan["backend"],
            plan["agent_name"],
            registry=CollectorRegistry(),
            fence_grace_s=plan["fence_grace_s"],
            **plan["options"],
        )
        self.pool = create_pool(plan["backend"], layout, plan["num_blocks"])
        self.sessions: dict[str, TransferSession] = {}
        self.releases: dict[str, list[str]] = {}

    def ping(self) -> dict:
        return {"pid": os.getpid()}

    def register(self) -> dict:
        return {"metadata": encode_metadata(self.backend.register_pool(self.pool))}

    def add_peer(self, metadata: str) -> dict:
        md = decode_metadata(metadata)
        self.backend.add_peer(md.agent_name, md)
        return {}

    def fill(self, block_ids: list[int], seed: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        for i in block_ids:
            view = byte_view(self.pool.tensor[i])
            view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8, generator=gen))
        return self.digest(block_ids)

    def digest(self, block_ids: list[int]) -> dict:
        h = hashlib.sha256()
        for i in block_ids:
            h.update(byte_view(self.pool.tensor[i]).numpy().tobytes())
        return {"digest": h.hexdigest()}

    def prepare_receive(self, request_id: str, block_ids: list[int], deadline_s: float) -> dict:
        handle = self.backend.prepare_receive(request_id, block_ids, deadline_s)
        self._watch(handle)
        return {"descriptors": _descriptors_to_json(handle.descriptors)}

    def send(self, request_id: str, block_ids: list[int], descriptors: dict, deadline_s: float):
        remote = _descriptors_from_json(descriptors)
        self._watch(self.backend.send(request_id, block_ids, remote, deadline_s))
        return {}

    def send_and_wait(
        self, request_id: str, block_ids: list[int], descriptors: dict, deadline_s: float
    ) -> dict:
        """One command, so the timing is not stretched by a pipe round trip."""
        self.send(request_id, block_ids, descriptors, deadline_s)
        return self.wait(request_id, spin=True)

    def poll(self, request_id: str) -> dict:
        session = self.sessions[request_id]
        return {"state": session.poll().value, "moved": session.handle.moved_bytes}

    def wait(self, request_id: str, spin: bool = False) -> dict:
        session = self.sessions[request_id]
        state = session.wait(0.0 if spin else 0.01)
        stats = session.handle.stats
        return {
            "state": state.value,
            "error": session.handle.error,
            "seconds": stats.seconds,
            "nbytes": stats.nbytes,
            "moved": session.handle.moved_bytes,
        }

    def abort(self, request_id: str) -> dict:
        self.sessions[request_id].abort()
        return {}

    def release_log(self) -> dict:
        return {"releases": self.releases}

    def close(self) -> dict:
        for session in self.sessions.values():
            session.close()
        self.backend.close()
        if isinstance(self.pool, SharedKVPool):
            self.pool.unlink()
        return {}

    def _watch(self, handle) -> None:
        rid = handle.request_id
        log = self.releases.setdefault(rid, [])
        self.sessions[rid] = TransferSession(self.backend, handle, lambda s: log.append(s.value))


def _peer_main(conn, spec_json: str) -> None:
    agent = _Agent(json.loads(spec_json))
    while True:
        try:
            msg = json.loads(conn.recv_bytes())
        except EOFError:
            return  # the parent went away
        op = msg.pop("op")
        try:
            reply = {"ok": True, **getattr(agent, op)(**msg)}
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        conn.send_bytes(json.dumps(reply).encode())
        if op == "close":
            # Everything that matters is closed; skipping interpreter teardown saves the
            # seconds NIXL/UCX destructors take at exit.
            conn.close()
            os._exit(0)


class PeerProcess:
    """Parent-side proxy; every call has a timeout so a stuck child fails the caller."""

    def __init__(self, plan: PeerPlan, *, start_timeout_s: float = 60.0):
        self.plan = plan
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_peer_main,
            args=(child, plan.to_json()),
            daemon=True,
            name=f"kvx-peer-{plan.agent_name}",
        )
        self.process.start()
        child.close()
        # Not waited for here, so several peers start (import torch, build pools) in
        # parallel; the first call collects this reply.
        self._conn.send_bytes(json.dumps({"op": "ping"}).encode())
        self._start_timeout_s: float | None = start_timeout_s

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def call(self, op: str, *, timeout_s: float = 30.0, **args: Any) -> dict:
        if self._start_timeout_s is not None:
            started, self._start_timeout_s = self._start_timeout_s, None
            self._reply("ping", started)
        self._conn.send_bytes(json.dumps({"op": op, **args}).encode())
        return self._reply(op, timeout_s)

    def _reply(self, op: str, timeout_s: float) -> dict:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"peer {self.plan.agent_name} did not answer {op!r} in {timeout_s}s")
        reply = json.loads(self._conn.recv_bytes())
        if not reply.pop("ok"):
            raise PeerError(f"{self.plan.agent_name}.{op}: {reply['error']}")
        return reply

    def register(self) -> AgentMetadata:
        return decode_metadata(self.call("register")["metadata"])

    def add_peer(self, metadata: AgentMetadata) -> None:
        self.call("add_peer", metadata=encode_metadata(metadata))

    def fill(self, block_ids: list[int], seed: int) -> str:
        return self.call("fill", block_ids=block_ids, seed=seed)["digest"]

    def digest(self, block_ids: list[int]) -> str:
        return self.call("digest", block_ids=block_ids)["digest"]

    def prepare_receive(
        self, request_id: str, block_ids: list[int], deadline_s: float
    ) -> ReceiveDescriptors:
        reply = self.call(
            "prepare_receive", request_id=request_id, block_ids=block_ids, deadline_s=deadline_s
        )
        return _descriptors_from_json(reply["descriptors"])

    def send(
        self, request_id: str, block_ids: list[int], remote: ReceiveDescriptors, deadline_s: float
    ) -> None:
        self.call(
            "send",
            request_id=request_id,
            block_ids=block_ids,
            descriptors=_descriptors_to_json(remote),
            deadline_s=deadline_s,
        )

    def send_and_wait(
        self, request_id: str, block_ids: list[int], remote: ReceiveDescriptors, deadline_s: float
    ) -> dict:
        return self.call(
            "send_and_wait",
            request_id=request_id,
            block_ids=block_ids,
            descriptors=_descriptors_to_json(remote),
            deadline_s=deadline_s,
            timeout_s=deadline_s + 10,
        )

    def poll(self, request_id: str) -> str:
        return self.call("poll", request_id=request_id)["state"]

    def moved_bytes(self, request_id: str) -> int:
        return self.call("poll", request_id=request_id)["moved"]

    def wait(self, request_id: str, timeout_s: float = 30.0, *, spin: bool = False) -> dict:
        """The final state, error, seconds and bytes; ``spin`` polls without sleeping."""
        return self.call("wait", request_id=request_id, spin=spin, timeout_s=timeout_s)

    def abort(self, request_id: str) -> None:
        self.call("abort", request_id=request_id)

    def releases(self) -> dict[str, list[str]]:
        return self.call("release_log")["releases"]

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        if self.process.is_alive():
            self.signal(signal.SIGKILL)
        self.process.join(timeout=10)
        # A SIGKILLed child cannot unlink its shared-memory pool; its name carries the pid.
        for leftover in SHM_DIR.glob(f"splitserve-kv-{self.pid}-*"):
            leftover.unlink(missing_ok=True)

    def stop(self) -> None:
        if self.process.is_alive():
            self.signal(signal.SIGCONT)  # a test may have left it stopped
            try:
                self.call("close", timeout_s=10)
            except (TimeoutError, PeerError, OSError, EOFError):
                pass
        self.process.join(timeout=10)
        self.kill()
        self._conn.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
