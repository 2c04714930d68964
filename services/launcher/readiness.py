"""Waiting for a stack to be ready: poll its /ready endpoint while watching the children."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.launcher.processes import ProcessGroup
from shared.rpc.auth import NO_AUTH, InternalAuth

# Readiness is probed on loopback; an HTTP(S)_PROXY in the environment must not intercept it.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class StartupTimeout(TimeoutError):
    """The stack did not become ready in time (every child was still running)."""


class StartupCancelled(RuntimeError):
    """Startup was interrupted (Ctrl-C, SIGTERM) before the stack was ready."""


def probe(url: str, timeout_s: float = 1.0) -> tuple[bool, str]:
    """(ready, what the endpoint answered): ready means HTTP 200."""
    try:
        with _OPENER.open(url, timeout=timeout_s) as resp:
            return resp.status == 200, f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        body = exc.read(300).decode(errors="replace").strip()
        return False, f"HTTP {exc.code} {body}".rstrip()
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return False, f"no answer ({reason})"


def health_probe(
    address: str, auth: InternalAuth = NO_AUTH, timeout_s: float = 1.0
) -> tuple[bool, str]:
    """(serving, status) of the grpc.health.v1 service at `address` (a worker), over TLS
    when the stack's internal calls use it."""
    with auth.sync_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            return False, f"no answer ({exc.code().name})"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, f"health {status}"


def services_ready(group: ProcessGroup) -> tuple[bool, str]:
    """Whether every service with a readiness check passes it; the first that does not."""
    for proc in group.processes.values():
        if not proc.alive:  # a supervised stack is restarting it
            return False, f"{proc.name}: not running"
        if proc.launch.ready is not None:
            ready, answer = proc.launch.ready()
            if not ready:
                return False, f"{proc.name}: {answer}"
    return True, "every service is ready"


def wait_until_ready(
    url: str,
    group: ProcessGroup,
    timeout_s: float,
    *,
    cancel: threading.Event | None = None,
    interval_s: float = 0.2,
    check: Callable[[], None] | None = None,
) -> None:
    """Return once `url` answers 200 and every service passes its own readiness check (the
    coordinator may be ready with one worker of several: startup waits for all of them).

    Raises ServiceDied as soon as any child exits (or, with `check`, whatever `check`
    raises: a supervised stack restarts what exits), StartupCancelled when `cancel` is set
    and StartupTimeout after `timeout_s` seconds.
    """
    check = check or group.check_alive
    deadline = time.monotonic() + timeout_s
    last = "not polled yet"
    while True:
        if cancel is not None and cancel.is_set():
            raise StartupCancelled("startup was interrupted")
        check()
        ready, last = probe(url, timeout_s=min(2.0, max(0.1, deadline - time.monotonic())))
        if ready:
            ready, last = services_ready(group)
            if ready:
                return
        if time.monotonic() >= deadline:
            raise StartupTimeout(f"{url} was not ready after {timeout_s:g} s; last answer: {last}")
        if cancel is not None:
            cancel.wait(interval_s)
        else:
            time.sleep(interval_s)
