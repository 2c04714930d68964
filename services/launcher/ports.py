"""Free TCP ports for a local stack whose config asks for port 0."""

from __future__ import annotations

import socket
from contextlib import ExitStack

from shared.config.schema import DeploymentConfig


def pick_free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports the kernel considers free on `host` right now.

    All sockets stay bound until every port is chosen, so the same port is never handed out
    twice; they are released before returning (a later bind can still race another program).
    """
    with ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(sock.getsockname()[1])
        return ports


def resolve_ports(config: DeploymentConfig, host: str = "127.0.0.1") -> DeploymentConfig:
    """The config with coordinator.port and coordinator.registry_port of 0 replaced."""
    coord = config.coordinator
    wanted = [name for name in ("port", "registry_port") if getattr(coord, name) == 0]
    if not wanted:
        return config
    chosen = dict(zip(wanted, pick_free_ports(len(wanted), host), strict=True))
    return config.model_copy(update={"coordinator": coord.model_copy(update=chosen)})
