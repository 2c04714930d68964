"""One gRPC channel per peer address, shared by every stub that talks to it.

A channel is a connection pool with its own reconnect backoff; opening one per call would
pay a TCP (and HTTP/2) handshake each time. A stub is cached beside its channel too: building
one makes a callable per RPC method, which the first token would otherwise pay for on every
request. The coordinator keeps one pool for its workers, a prefill replica one for the decode
replicas it pushes KV to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import grpc

from shared.rpc.auth import NO_AUTH, InternalAuth

S = TypeVar("S")

# A peer that restarts comes back within seconds, often at the same address (a pod keeps its
# IP across container restarts): retry the connection at least every second instead of
# gRPC's default backoff of up to 120 s, which would keep a replaced peer unreachable.
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


class ChannelPool:
    def __init__(self, auth: InternalAuth = NO_AUTH) -> None:
        self._auth = auth  # every channel carries the deployment's token, if it has one
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[tuple[str, Callable], object] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._auth.channel(address, options=RECONNECT_OPTIONS)
            self._channels[address] = channel
        return channel

    def stub(self, address: str, kind: Callable[[grpc.aio.Channel], S]) -> S:
        """The `kind` stub (a generated `...Stub` class) over `address`'s channel."""
        key = (address, kind)
        stub = self._stubs.get(key)
        if stub is None:
            stub = self._stubs[key] = kind(self.get(address))
        return stub  # type: ignore[return-value]

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        self._stubs = {}
        for channel in channels:
            await channel.close()
