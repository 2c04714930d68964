"""`splitserve up`: the one-command local deployment, in the foreground until interrupted.

It stops on Ctrl-C, SIGTERM or SIGHUP, or when the supervisor gives up on a service (one
that keeps failing to start); a service that merely dies is restarted and the rest serve on.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from services.launcher.processes import ServiceDied
from services.launcher.readiness import StartupCancelled, StartupTimeout
from services.launcher.stack import LocalStack, start_local_stack
from services.launcher.supervisor import ServiceGaveUp
from shared.config.schema import ConfigError, DeploymentConfig

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# A service that dies in the same instant as a Ctrl-C (the terminal signals the whole process
# group) is part of the shutdown, not a crash; this is how long that race is given.
_SHUTDOWN_RACE_S = 0.3


def run_up(
    config: DeploymentConfig,
    startup_timeout_s: float = 300.0,
    out: TextIO | None = None,
    err: TextIO | None = None,
    tls: bool = False,
) -> int:
    """Start the stack, announce it, and wait for a stop signal. Returns the exit code."""
    out = out or sys.stdout
    err = err or sys.stderr
    with _stop_requested() as stop:
        try:
            stack = start_local_stack(config, startup_timeout_s, echo=err, cancel=stop, tls=tls)
        except StartupCancelled:
            return 0
        except ServiceGaveUp as exc:
            return _error(err, f"{exc.message} (before splitserve was ready)")
        except ServiceDied as exc:
            return _error(err, f"{exc.name} exited before splitserve was ready: {_rest(exc)}")
        except (StartupTimeout, ConfigError) as exc:
            return _error(err, str(exc))
        with stack:
            models = ", ".join(m.id for m in stack.config.models)
            print(f"splitserve is ready: {stack.base_url} (model: {models})", file=out, flush=True)
            for coordinator in stack.coordinators[1:]:  # same workers, same view
                print(
                    f"also serving: {coordinator.url}/v1 ({coordinator.name})", file=err, flush=True
                )
            if stack.config.playground.enabled:
                print(f"playground: {stack.url}/playground/", file=err, flush=True)
            print(f"logs: {stack.run_dir}", file=err, flush=True)
            return _serve_until_stopped(stack, stop, err)


def _serve_until_stopped(stack: LocalStack, stop: threading.Event, err: TextIO) -> int:
    """Serve (the supervisor restarts what dies) until a stop signal, or until a service
    keeps failing to start."""
    while not stop.wait(0.5):
        failure = stack.failure
        if failure is not None:
            if stop.wait(_SHUTDOWN_RACE_S):
                break
            return _error(err, failure.message)
    return 0


def _rest(exc: ServiceDied) -> str:
    return str(exc).removeprefix(f"{exc.name} ")


def _error(err: TextIO, message: str) -> int:
    print(f"splitserve: error: {message}", file=err, flush=True)
    return 1


@contextmanager
def _stop_requested() -> Iterator[threading.Event]:
    """An event set by Ctrl-C, SIGTERM or SIGHUP; the previous handlers come back afterwards."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in _STOP_SIGNALS}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
