"""Which coordinators a worker registers with: every address its registry endpoints resolve to.

Workers push to every coordinator, rather than coordinators discovering workers, because the
router's index is a function of each worker's own ordered stream of KV events
(services/router/index.py): any coordinator fed a worker's stream holds the same view of it,
and one that starts late or restarts is brought up to date by the full snapshot the worker
sends whenever it (re)registers. Discovery the other way round would have every coordinator
list every worker pool (the Kubernetes API, or one headless Service per pool) and pull the
events that already flow by push. In Kubernetes the coordinators' headless registry Service
resolves to every coordinator pod, so a pod that comes or goes is seen at the next lookup;
locally `splitserve up` lists one address per coordinator process.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterable

log = logging.getLogger(__name__)


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port" (the config validated the shape)."""
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def join_address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


async def resolve_registries(endpoints: Iterable[str]) -> list[str]:
    """Every coordinator address the endpoints name now, in a stable order; an endpoint that
    does not resolve (no coordinator pod yet) contributes nothing and is logged."""
    loop = asyncio.get_running_loop()
    addresses: dict[str, None] = {}
    for endpoint in endpoints:
        host, port = split_endpoint(endpoint)
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            log.warning("registry endpoint %s does not resolve: %s", endpoint, exc)
            continue
        v4 = sorted({str(i[4][0]) for i in infos if i[0] == socket.AF_INET})
        v6 = sorted({str(i[4][0]) for i in infos if i[0] == socket.AF_INET6})
        # A dual-stack pod answers in both families: one family only, or the worker would
        # register twice with the same coordinator.
        for ip in v4 or v6:
            addresses[join_address(ip, port)] = None
    return list(addresses)
