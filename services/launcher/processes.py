"""Child processes of the local launcher: started together, echoed by name, never orphaned.

Each child's stdout and stderr go to its own log file and, optionally, to an echo stream with a
`[name] ` prefix. On Linux every child asks the kernel for SIGTERM when its parent dies
(PR_SET_PDEATHSIG), so a launcher killed with -9 does not leave services running.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

_PR_SET_PDEATHSIG = 1
_TAIL_BYTES = 16 * 1024


# (ready, what the service answered), e.g. (False, "health NOT_SERVING").
ReadyCheck = Callable[[], tuple[bool, str]]


@dataclass(frozen=True)
class ServiceLaunch:
    """What to run for one service. `env` is added on top of the launcher's environment."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    # Stopped in a second wave, after everything else has exited (the coordinator: workers
    # deregister from it while shutting down).
    stop_last: bool = False
    # Whether this start of the service serves yet; None: running counts as ready.
    ready: ReadyCheck | None = None
    # The spec of the next start after this one died (a worker takes a fresh port); None:
    # the same spec again.
    renew: Callable[[], ServiceLaunch] | None = None


class ServiceDied(RuntimeError):
    """A service exited while it was supposed to be running."""

    def __init__(self, name: str, returncode: int, log_path: Path, log_tail: str):
        self.name = name
        self.returncode = returncode
        self.log_path = log_path
        self.log_tail = log_tail
        super().__init__(
            f"{name} exited with {describe_exit(returncode)}; "
            f"last lines of its log ({log_path}):\n{log_tail}"
        )


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"code {returncode}"


class ServiceProcess:
    """One running child; its output is drained by a reader thread so the child never blocks."""

    def __init__(
        self,
        launch: ServiceLaunch,
        log_path: Path,
        echo: TextIO | None,
        echo_lock: threading.Lock,
        preexec: Callable[[], None] | None,
        header: str = "",
    ):
        self.launch = launch
        self.log_path = log_path
        self._echo = echo
        self._echo_lock = echo_lock
        # Appended to: a restarted service's log keeps what its earlier starts wrote.
        self._log = open(log_path, "ab")  # closed by the reader thread
        if header:
            self._log.write(f"{header}\n".encode())
            self._log.flush()
        try:
            self._popen = subprocess.Popen(
                list(launch.argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env={**os.environ, **launch.env},
                preexec_fn=preexec,
                close_fds=True,
            )
        except BaseException:
            self._log.close()
            raise
        self._reader = threading.Thread(
            target=self._drain, name=f"output:{launch.name}", daemon=True
        )
        self._reader.start()

    @property
    def name(self) -> str:
        return self.launch.name

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def alive(self) -> bool:
        return self._popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` unless the child has already been reaped (so a reused pid is never hit)."""
        self._popen.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code, or None if the child is still running after `timeout` seconds."""
        try:
            return self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def finish_output(self, timeout: float = 2.0) -> None:
        """Wait for the reader to reach end of output (bounded: a grandchild may hold the pipe)."""
        self._reader.join(timeout)

    def log_tail(self, lines: int = 20) -> str:
        if not self.alive:
            self.finish_output()
        with open(self.log_path, "rb") as f:
            f.seek(max(0, self.log_path.stat().st_size - _TAIL_BYTES))
            data = f.read()
        return "\n".join(data.decode(errors="replace").splitlines()[-lines:])

    def _drain(self) -> None:
        assert self._popen.stdout is not None
        with self._log, self._popen.stdout as out:
            for line in iter(out.readline, b""):
                self._log.write(line)
                self._log.flush()
                self._echo_line(line)

    def _echo_line(self, line: bytes) -> None:
        text = f"[{self.name}] {line.decode(errors='replace').rstrip()}\n"
        if self._echo is not None and not echo_text(self._echo, self._echo_lock, text):
            self._echo = None


def echo_text(echo: TextIO, lock: threading.Lock, text: str) -> bool:
    """Write to the echo stream; False when it went away (closed terminal, finished test
    capture): the log files still get everything."""
    with lock:
        try:
            echo.write(text)
            echo.flush()
        except (OSError, ValueError):
            return False
    return True


class ProcessGroup:
    """Children started in order and stopped in waves: SIGTERM, a grace period, then SIGKILL.

    The children stay in the launcher's process group (Ctrl-C in a terminal reaches them too).
    PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, so start services from
    a thread that lives as long as the group (normally the main thread).
    """

    def __init__(self, log_dir: Path, echo: TextIO | None = None):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._echo = echo
        self._echo_lock = threading.Lock()
        self._processes: dict[str, ServiceProcess] = {}
        self._preexec = _die_with_parent_hook()

    def start(self, launch: ServiceLaunch) -> ServiceProcess:
        if launch.name in self._processes:
            raise ValueError(f"a service named {launch.name!r} is already in this group")
        log_path = self.log_dir / f"{launch.name.replace('/', '_')}.log"
        log_path.unlink(missing_ok=True)
        proc = ServiceProcess(launch, log_path, self._echo, self._echo_lock, self._preexec)
        self._processes[launch.name] = proc
        return proc

    def restart(self, launch: ServiceLaunch, header: str) -> ServiceProcess:
        """Start `spec` again in place of its exited process; its log goes on after `header`."""
        old = self._processes[launch.name]
        if old.alive:
            raise ValueError(f"{launch.name} is still running")
        old.finish_output()
        proc = ServiceProcess(
            launch, old.log_path, self._echo, self._echo_lock, self._preexec, header=header
        )
        self._processes[launch.name] = proc
        return proc

    def announce(self, text: str) -> None:
        """A line of the launcher's own on the echo stream (restarts, give-ups)."""
        if self._echo is not None and not echo_text(self._echo, self._echo_lock, text + "\n"):
            self._echo = None

    @property
    def processes(self) -> dict[str, ServiceProcess]:
        return dict(self._processes)

    def first_exited(self) -> ServiceProcess | None:
        return next((p for p in self._processes.values() if not p.alive), None)

    def check_alive(self) -> None:
        """Raise ServiceDied for the first child that is no longer running."""
        dead = self.first_exited()
        if dead is not None:
            returncode = dead.returncode
            assert returncode is not None
            raise ServiceDied(dead.name, returncode, dead.log_path, dead.log_tail())

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop everything within about `grace_s` seconds; the `stop_last` wave goes second."""
        deadline = time.monotonic() + grace_s
        procs = list(self._processes.values())
        waves = [
            [p for p in procs if not p.launch.stop_last],
            [p for p in procs if p.launch.stop_last],
        ]
        for i, wave in enumerate(waves):
            # The last wave always gets a moment, even if the first used up the grace period.
            wave_deadline = deadline if i == 0 else max(deadline, time.monotonic() + 1.0)
            _terminate(wave, wave_deadline)
        for p in procs:
            p.finish_output()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _terminate(procs: list[ServiceProcess], deadline: float) -> None:
    for p in procs:
        p.kill(signal.SIGTERM)
    for p in procs:
        p.wait(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.alive:
            p.kill(signal.SIGKILL)
            p.wait(5.0)


def _die_with_parent_hook() -> Callable[[], None] | None:
    """A preexec_fn asking for SIGTERM when the parent dies; None where prctl does not exist."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    # Resolved here, in the parent: the forked child should only make the one system call.
    parent = os.getpid()
    sigterm = int(signal.SIGTERM)

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, sigterm, 0, 0, 0)
        # The parent may have died between fork and prctl; then no signal would ever come.
        if os.getppid() != parent:
            os._exit(1)

    return hook
