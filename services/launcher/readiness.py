"""Waiting for a stack to be ready: poll its /ready endpoint while watching the children."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

from services.launcher.processes import ProcessGroup

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


def wait_until_ready(
    url: str,
    group: ProcessGroup,
    timeout_s: float,
    *,
    cancel: threading.Event | None = None,
    interval_s: float = 0.2,
) -> None:
    """Return once `url` answers 200.

    Raises ServiceDied as soon as any child exits, StartupCancelled when `cancel` is set and
    StartupTimeout after `timeout_s` seconds.
    """
    deadline = time.monotonic() + timeout_s
    last = "not polled yet"
    while True:
        if cancel is not None and cancel.is_set():
            raise StartupCancelled("startup was interrupted")
        group.check_alive()
        ready, last = probe(url, timeout_s=min(2.0, max(0.1, deadline - time.monotonic())))
        if ready:
            return
        if time.monotonic() >= deadline:
            raise StartupTimeout(f"{url} was not ready after {timeout_s:g} s; last answer: {last}")
        if cancel is not None:
            cancel.wait(interval_s)
        else:
            time.sleep(interval_s)
