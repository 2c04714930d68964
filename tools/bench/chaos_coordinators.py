"""`bench chaos --coordinators N`'s scenario kill_coordinator: SIGKILL of the last coordinator
while streams run through every coordinator.

A coordinator killed with -9 cannot say goodbye: its clients see their connections cut
(no SSE error can be written by a dead process), and only those. Measured: which streams
failed (on the killed coordinator, or — the target: none — on the others), how soon a new
request succeeds on a survivor (`new_request_s`, target < 2 s), and, once the supervisor has
restarted it, how soon the restarted coordinator holds the same view of the fleet as the
others (`converged_s`, from its first /health answer to every worker registered with it and
the same KV index, per worker, as the survivors: the workers' snapshots).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import httpx

from services.launcher import LocalStack
from services.launcher.readiness import probe
from shared.modelfile.default import DEFAULT_MODEL_ID


class _Stream(Protocol):
    coordinator: int
    tokens: int


def ready(url: str) -> dict[str, Any]:
    try:
        return httpx.get(f"{url}/ready", timeout=5, trust_env=False).json()
    except (httpx.HTTPError, ValueError):
        return {"ready": False, "workers": {}}


def fleet_view(url: str) -> dict[str, tuple[int, int]]:
    """A coordinator's index per live, routable worker: (last KV event seq, blocks held)."""
    workers = ready(url)["workers"]
    return {
        w: (i["kv_event_seq"], i["kv_blocks"])
        for w, i in workers.items()
        if i["alive"] and not i["draining"]
    }


def one_view(stack: LocalStack, workers: int) -> bool:
    """Every coordinator routes to all `workers` and holds the same index of each."""
    views = [fleet_view(url) for url in stack.coordinator_urls]
    return len(views[0]) == workers and all(v == views[0] for v in views)


class CoordinatorHit:
    """Kills the last coordinator once one of its streams satisfies `when`, then times a new
    request on the first coordinator (on a thread: the streams' loop must not wait for it)."""

    def __init__(self, stack: LocalStack, when: Callable[[_Stream], bool]):
        self.stack, self.when = stack, when
        self.index = len(stack.coordinators) - 1
        self.name = stack.coordinators[self.index].name
        self.at = 0.0
        self.restarts = 0
        self.new_request_s: float | None = None
        self._probe: threading.Thread | None = None

    def __call__(self, results: list) -> bool:
        if not any(r.coordinator == self.index and self.when(r) for r in results):
            return False
        self.restarts = self.stack.supervisor.restarts(self.name)
        self.at = time.monotonic()
        self.stack.processes[self.name].kill(signal.SIGKILL)
        self._probe = threading.Thread(target=self._time_new_request, daemon=True)
        self._probe.start()
        return True

    def _time_new_request(self, timeout_s: float = 30.0) -> None:
        body = {
            "model": DEFAULT_MODEL_ID,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 4,
            "temperature": 0,
        }
        url = f"{self.stack.coordinator_urls[0]}/v1/chat/completions"
        while time.monotonic() - self.at < timeout_s:
            try:
                if httpx.post(url, json=body, timeout=5, trust_env=False).status_code == 200:
                    self.new_request_s = round(time.monotonic() - self.at, 3)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.01)

    def finish(self) -> None:
        if self._probe is not None:
            self._probe.join(35.0)

    def converged(self, workers: int, timeout_s: float) -> tuple[float | None, float | None]:
        """(recovery_s: kill to the restarted coordinator sharing the survivors' view,
        converged_s: its first /health answer to that view)."""
        url = self.stack.coordinator_urls[self.index]
        deadline = self.at + timeout_s
        answered = None
        while time.monotonic() < deadline:
            restarted = self.stack.supervisor.restarts(self.name) > self.restarts
            if restarted and answered is None and probe(f"{url}/health", 0.5)[0]:
                answered = time.monotonic()
            if answered is not None and one_view(self.stack, workers):
                now = time.monotonic()
                return round(now - self.at, 2), round(now - answered, 2)
            time.sleep(0.02)
        return None, None
