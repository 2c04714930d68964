"""Free TCP ports for a local stack whose config asks for port 0."""

from __future__ import annotations

import random
import socket
from contextlib import ExitStack
from pathlib import Path

from shared.config.schema import DeploymentConfig

# Where the kernel hands out ports to binds of port 0 and to outgoing connections.
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Ports below the ephemeral range that a stack's children may take (above the common
# well-known and registered services' ports most machines run).
LOWEST_PORT = 10000


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int] | None:
    """The kernel's ephemeral port range, or None where it cannot be read (not Linux)."""
    try:
        low, high = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return None
    return low, high


def pick_free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports the kernel considers free on `host` right now.

    A child binds its port seconds later (after loading a model). A port from the ephemeral
    range could be taken meanwhile by any process's bind to port 0 or outgoing connection
    (a CI run lost a worker so, to a transfer backend's listener), so ports are drawn below
    that range, where only an explicit bind takes them; where no such port is free (or the
    range is unknown) the kernel's own choice is taken. All sockets stay bound until every
    port is chosen, so the same port is never handed out twice; they are released before
    returning (a later bind can still race a program that asks for that very port).
    """
    span = ephemeral_range()
    candidates = list(range(LOWEST_PORT, span[0])) if span and span[0] > LOWEST_PORT else []
    random.shuffle(candidates)
    with ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < count:
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            while True:
                port = candidates.pop() if candidates else 0
                try:
                    sock.bind((host, port))
                    break
                except OSError:
                    if port == 0:
                        raise
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
