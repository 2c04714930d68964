"""Keeping a local stack serving: a service that dies is started again, the others go on.

While one worker is down the coordinator routes around it (streams it was serving migrate to
another replica); the restarted process registers under the same replica name, which
replaces its old registry entry. Restarts back off (RESTART_BASE_S, doubling per death in
the last CRASH_WINDOW_S, at most RESTART_MAX_S). The supervisor gives up — and the launcher
stops, with the reason and the log's last lines — only when a service keeps failing to
start (MAX_FAILED_STARTS deaths in a row before it was ready), or exits with a code saying
that starting it again cannot help (refused registration, bad config, failed quality gate).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from services.launcher.processes import ProcessGroup, ServiceDied, ServiceProcess, describe_exit

RESTART_BASE_S = 0.5
RESTART_MAX_S = 10.0
CRASH_WINDOW_S = 60.0
MAX_FAILED_STARTS = 5
# A service without a readiness check counts as started once it has run this long.
UNCHECKED_READY_S = 2.0
# Exit codes of `splitserve serve` that a restart would only repeat.
REFUSALS = {
    2: "its command line or config was refused",
    3: "the coordinator refused its registration",
    4: "its model failed the quality gate",
}


class ServiceGaveUp(ServiceDied):
    """A service the supervisor will not start again; `verdict` completes "<name> …"."""

    def __init__(self, died: ServiceDied, verdict: str):
        super().__init__(died.name, died.returncode, died.log_path, died.log_tail)
        self.verdict = verdict

    @property
    def message(self) -> str:
        return f"{self.name} {self.verdict}: {str(self).removeprefix(f'{self.name} ')}"


@dataclass
class _Watch:
    """What the supervisor tracks about one service."""

    started_at: float
    ready: bool
    failed_starts: int = 0  # deaths in a row before a start was ready
    restarts: int = 0
    deaths: deque[float] = field(default_factory=deque)
    restart_at: float | None = None  # set while dead and waiting out the backoff

    def backoff_s(self, now: float) -> float:
        while self.deaths and now - self.deaths[0] > CRASH_WINDOW_S:
            self.deaths.popleft()
        return min(RESTART_MAX_S, RESTART_BASE_S * 2 ** max(0, len(self.deaths) - 1))


class Supervisor:
    """Watches every process of `group` from its own thread and restarts the dead ones.

    Restarted children are forked by this thread, and PR_SET_PDEATHSIG fires when the forking
    thread exits: `halt()` stops restarts, but the thread lives on until `close()`, which the
    stack calls after the group has stopped.
    """

    def __init__(self, group: ProcessGroup, poll_s: float = 0.2, *, started: bool = True):
        """`started`: every process of `group` already serves (False: they are starting, and
        a death before one is ready counts as a failed start)."""
        self.group = group
        self.poll_s = poll_s
        now = time.monotonic()
        self._watch = {name: _Watch(now, ready=started) for name in group.processes}
        self.failure: ServiceGaveUp | None = None
        self.failed = threading.Event()
        self._halt = threading.Event()
        self._release = threading.Event()
        self._lock = threading.Lock()  # one pass at a time; halt() waits for the current one
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def restarts(self, name: str) -> int:
        return self._watch[name].restarts

    def is_ready(self, name: str) -> bool:
        return self._watch[name].ready and self.group.processes[name].alive

    def halt(self) -> None:
        """No restart from now on (the stack is stopping)."""
        self._halt.set()
        with self._lock:
            pass

    def close(self) -> None:
        self.halt()
        self._release.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def _run(self) -> None:
        while not self._halt.wait(self.poll_s):
            with self._lock:
                if self._halt.is_set():
                    break
                for proc in self.group.processes.values():
                    self._check(proc, time.monotonic())
                if self.failure is not None:
                    break
        self._release.wait()

    def _check(self, proc: ServiceProcess, now: float) -> None:
        watch = self._watch[proc.name]
        if proc.alive:
            if not watch.ready and self._started(proc, watch, now):
                watch.ready = True
                watch.failed_starts = 0
                if watch.restarts:
                    self.group.announce(f"splitserve: {proc.name} is serving again")
            return
        if watch.restart_at is None:
            self._died(proc, watch, now)
        elif now >= watch.restart_at and self.failure is None:
            self._restart(proc, watch, now)

    def _started(self, proc: ServiceProcess, watch: _Watch, now: float) -> bool:
        if proc.launch.ready is None:
            return now - watch.started_at >= UNCHECKED_READY_S
        return proc.launch.ready()[0]

    def _died(self, proc: ServiceProcess, watch: _Watch, now: float) -> None:
        returncode = proc.returncode
        assert returncode is not None
        died = ServiceDied(proc.name, returncode, proc.log_path, proc.log_tail())
        if returncode in REFUSALS:
            self._give_up(ServiceGaveUp(died, f"stopped unexpectedly ({REFUSALS[returncode]})"))
            return
        if not watch.ready:
            watch.failed_starts += 1
        if watch.failed_starts >= MAX_FAILED_STARTS:
            verdict = f"keeps failing to start ({watch.failed_starts} starts in a row died)"
            self._give_up(ServiceGaveUp(died, verdict))
            return
        watch.deaths.append(now)
        delay = watch.backoff_s(now)
        watch.restart_at = now + delay
        watch.ready = False
        self.group.announce(
            f"splitserve: {proc.name} exited with {describe_exit(returncode)}; "
            f"restarting in {delay:g} s (log: {proc.log_path})"
        )

    def _restart(self, proc: ServiceProcess, watch: _Watch, now: float) -> None:
        launch = proc.launch.renew() if proc.launch.renew is not None else proc.launch
        returncode = proc.returncode
        assert returncode is not None
        header = (
            f"--- splitserve: restart {watch.restarts + 1} of {proc.name} "
            f"(the last start exited with {describe_exit(returncode)}) ---"
        )
        self.group.restart(launch, header)
        # Counted once the new process is in the group: whoever sees the count sees it.
        watch.restarts += 1
        watch.restart_at = None
        # From when the new process exists: a fork that took long on a loaded machine must
        # not count towards the "alive long enough to be ready" time of a child that dies.
        watch.started_at = max(now, time.monotonic())

    def _give_up(self, failure: ServiceGaveUp) -> None:
        self.failure = failure
        self.failed.set()
