"""One gRPC channel per peer address, shared by every stub that talks to it.

A channel is a connection pool with its own reconnect backoff; opening one per call would
pay a TCP (and HTTP/2) handshake each time. The coordinator keeps one pool for its workers,
a prefill replica one for the decode replicas it pushes KV to.
"""

from __future__ import annotations

import grpc


class ChannelPool:
    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address)
            self._channels[address] = channel
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
