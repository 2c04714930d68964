"""The launcher's supervisor with real child processes: a dead service comes back (its log
kept), one that keeps failing to start or refuses to serve is given up on with its reason."""

from __future__ import annotations

import io
import signal
import sys
import textwrap
import time
from dataclasses import dataclass

import pytest

from services.launcher import supervisor as supervisor_module
from services.launcher.processes import ProcessGroup, ServiceLaunch
from services.launcher.supervisor import MAX_FAILED_STARTS, Supervisor
from tests.waiting import wait_until

PY = sys.executable

TEST_CHILD = """
    # Test child: prints its start, then sleeps (at most 60 s, so a failed test cannot leak
    # it), or with an exit code as argument exits with it at once.
    import sys, time
    print("test child started", flush=True)
    if len(sys.argv) > 1:
        print("test child failing", file=sys.stderr, flush=True)
        sys.exit(int(sys.argv[1]))
    time.sleep(60)
"""


@pytest.fixture
def child(tmp_path) -> str:
    path = tmp_path / "test_child.py"
    path.write_text(textwrap.dedent(TEST_CHILD))
    return str(path)


@dataclass
class Watched:
    """A process group, its echo stream, and the supervisor watching it (once started)."""

    group: ProcessGroup
    echo: io.StringIO
    supervisor: Supervisor | None = None

    def supervise(self) -> Supervisor:
        self.supervisor = Supervisor(self.group, poll_s=0.05).start()
        return self.supervisor


@pytest.fixture
def watched(tmp_path):
    echo = io.StringIO()
    w = Watched(ProcessGroup(tmp_path / "logs", echo), echo)
    yield w
    if w.supervisor is not None:
        w.supervisor.halt()
    w.group.stop(grace_s=1.0)
    if w.supervisor is not None:
        w.supervisor.close()


@pytest.fixture(autouse=True)
def _fast_backoff(monkeypatch):
    monkeypatch.setattr(supervisor_module, "RESTART_BASE_S", 0.05)
    monkeypatch.setattr(supervisor_module, "UNCHECKED_READY_S", 0.3)


def test_a_killed_service_is_restarted_the_others_untouched_and_its_log_kept(watched, child):
    group = watched.group
    victim = group.start(ServiceLaunch("w0", [PY, child]))
    other = group.start(ServiceLaunch("w1", [PY, child]))
    assert wait_until(lambda: "started" in victim.log_path.read_text())
    supervisor = watched.supervise()
    victim.kill(signal.SIGKILL)
    assert wait_until(lambda: supervisor.restarts("w0") == 1 and supervisor.is_ready("w0"))
    revived = group.processes["w0"]
    assert revived.pid != victim.pid and revived.alive
    assert group.processes["w1"] is other and other.alive and supervisor.restarts("w1") == 0
    assert wait_until(lambda: victim.log_path.read_text().count("test child started") == 2)
    log = victim.log_path.read_text()
    assert "--- splitserve: restart 1 of w0 (the last start exited with signal SIGKILL)" in log
    assert "w0 exited with signal SIGKILL; restarting in" in watched.echo.getvalue()
    assert "w0 is serving again" in watched.echo.getvalue()
    assert supervisor.failure is None


@pytest.mark.parametrize(
    ("exit_code", "restarts", "verdict"),
    [
        # Every restart dies at once: given up after MAX_FAILED_STARTS of them.
        (
            1,
            MAX_FAILED_STARTS,
            f"keeps failing to start ({MAX_FAILED_STARTS} starts in a row died)",
        ),
        # Code 3, the coordinator refused it: a restart would only be refused again.
        (3, 1, "stopped unexpectedly (the coordinator refused its registration)"),
    ],
)
def test_given_up_on_with_the_reason_and_the_log(watched, child, exit_code, restarts, verdict):
    # Its first start passes as ready (it sleeps); every later start exits with `exit_code`.
    failing = ServiceLaunch("decode-0", [PY, child, str(exit_code)])
    proc = watched.group.start(ServiceLaunch("decode-0", [PY, child], renew=lambda: failing))
    assert wait_until(lambda: proc.log_path.exists())
    supervisor = watched.supervise()
    proc.kill(signal.SIGKILL)
    assert supervisor.failed.wait(30)
    assert supervisor.restarts("decode-0") == restarts
    failure = supervisor.failure
    assert failure.verdict == verdict and failure.returncode == exit_code
    assert failure.message.startswith(f"decode-0 {verdict}: exited with code {exit_code}")
    assert "test child failing" in failure.log_tail
    time.sleep(0.3)
    assert not watched.group.processes["decode-0"].alive  # given up: not started again
