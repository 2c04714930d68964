"""The local launcher's process management, with real child processes.

The children here are small test programs written to tmp_path (a /ready server, a crasher, a
sleeper, a launcher-like parent), not the splitserve services: what is under test is starting,
watching, stopping and never orphaning processes.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from services.launcher import stack as stack_module
from services.launcher.ports import pick_free_ports, resolve_ports
from services.launcher.processes import ProcessGroup, ServiceDied, ServiceLaunch
from services.launcher.readiness import (
    StartupCancelled,
    StartupTimeout,
    probe,
    wait_until_ready,
)
from services.launcher.stack import (
    coordinator_slots,
    resolve_config,
    service_launches,
    start_local_stack,
    worker_slots,
)
from services.launcher.up import run_up
from shared.config.schema import ConfigError, load_config, parse_config
from tests.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
# gRPC core's log format: severity letter, MMDD, time, thread id, file:line]
_GRPC_CORE_LINE = re.compile(r"[EWID]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]")
PY = sys.executable

TEST_CHILD_READY_SERVER = """
    # Test child: answers GET /ready with 503 until DELAY seconds after start, then 200.
    import http.server, sys, time
    port, delay = int(sys.argv[1]), float(sys.argv[2])
    ready_at = time.monotonic() + delay
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ready = time.monotonic() >= ready_at
            self.send_response(200 if ready and self.path == "/ready" else 503)
            self.end_headers()
            self.wfile.write(b'{"ready": %s}' % (b"true" if ready else b"false"))
        def log_message(self, *args):
            pass
    server = http.server.HTTPServer(("127.0.0.1", port), Handler)
    print("test ready server listening", flush=True)
    server.serve_forever()
"""

TEST_CHILD_CRASH = """
    # Test child: prints a few lines, then fails: after 0.3 s, or once the file named by its
    # argument exists (at most 30 s).
    import os, sys, time
    print("test crasher starting", flush=True)
    if len(sys.argv) > 1:
        deadline = time.monotonic() + 30
        while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        time.sleep(0.3)
    print("boom: simulated failure", file=sys.stderr, flush=True)
    sys.exit(3)
"""

TEST_CHILD_SLEEPER = """
    # Test child: records the SIGTERM it gets (name appended to MARKER) and exits, or with
    # --ignore-term shrugs SIGTERM off. Sleeps at most 60 s so a failed test cannot leak it.
    import signal, sys, time
    marker, name = sys.argv[1], sys.argv[2]
    def on_term(signum, frame):
        with open(marker, "a") as f:
            f.write(name + "\\n")
        sys.exit(0)
    ignore = "--ignore-term" in sys.argv
    signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore else on_term)
    print("test sleeper sleeping", flush=True)
    time.sleep(60)
"""

TEST_CHILD_LAUNCHER = """
    # Test child: a launcher-like parent that starts two sleepers through ProcessGroup,
    # prints their pids, and waits to be killed.
    import json, sys, time
    from pathlib import Path
    from services.launcher.processes import ProcessGroup, ServiceLaunch
    log_dir, sleeper, marker = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    group = ProcessGroup(log_dir)
    pids = [
        group.start(ServiceLaunch(f"s{i}", [sys.executable, sleeper, marker, f"s{i}"])).pid
        for i in range(2)
    ]
    print(json.dumps(pids), flush=True)
    time.sleep(60)
"""


@pytest.fixture(autouse=True)
def _time_limit():
    """Every test here finishes in seconds; one that hangs fails instead of stalling the suite."""

    def expire(signum, frame):
        raise TimeoutError("test ran past its 60 s limit")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def leftover_children(tmp_path):
    """This test's children (programs under its tmp_path) that are still running. Other
    processes of the test worker are not this test's business: multiprocessing's resource
    tracker, or a `python3` helper some library started meanwhile (one started mid-test under
    CI load once failed this check, though every child of the stack had gone)."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}

    def ours(process: psutil.Process) -> bool:
        try:
            return any(str(tmp_path) in arg for arg in process.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            return False  # gone (or exiting) meanwhile: not left over

    def still_running() -> list[psutil.Process]:
        now = psutil.Process().children(recursive=True)
        return [p for p in now if p.pid not in before and ours(p)]

    return still_running


@pytest.fixture
def children(tmp_path) -> dict[str, str]:
    programs = {
        "ready_server": TEST_CHILD_READY_SERVER,
        "crash": TEST_CHILD_CRASH,
        "sleeper": TEST_CHILD_SLEEPER,
        "launcher": TEST_CHILD_LAUNCHER,
    }
    paths = {}
    for name, source in programs.items():
        path = tmp_path / f"test_child_{name}.py"
        path.write_text(textwrap.dedent(source))
        paths[name] = str(path)
    return paths


@pytest.fixture
def echo() -> io.StringIO:
    return io.StringIO()


@pytest.fixture
def group(tmp_path, echo):
    group = ProcessGroup(tmp_path / "logs", echo)
    yield group
    group.stop(grace_s=1.0)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


_wait_until = wait_until


def _wait_for_log(log_path: Path, text: str) -> None:
    assert _wait_until(lambda: log_path.exists() and text in log_path.read_text()), log_path


def test_readiness_wait_returns_once_ready(group, echo, children):
    (port,) = pick_free_ports(1)
    group.start(ServiceLaunch("server", [PY, children["ready_server"], str(port), "0.5"]))
    url = f"http://127.0.0.1:{port}/ready"
    start = time.monotonic()
    wait_until_ready(url, group, timeout_s=20, interval_s=0.05)
    assert time.monotonic() - start >= 0.45  # it really waited for the 200, not the first answer
    assert probe(url) == (True, "HTTP 200")
    assert _wait_until(lambda: "[server] test ready server listening" in echo.getvalue())


def test_readiness_times_out_with_the_last_answer(group, children):
    (port,) = pick_free_ports(1)
    group.start(ServiceLaunch("server", [PY, children["ready_server"], str(port), "1000"]))
    url = f"http://127.0.0.1:{port}/ready"
    _wait_for_log(group.log_dir / "server.log", "listening")
    with pytest.raises(StartupTimeout, match='HTTP 503 {"ready": false}'):
        wait_until_ready(url, group, timeout_s=0.5, interval_s=0.05)


def test_readiness_wait_stops_when_cancelled(group, children):
    (port,) = pick_free_ports(1)
    group.start(ServiceLaunch("server", [PY, children["ready_server"], str(port), "1000"]))
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    with pytest.raises(StartupCancelled):
        wait_until_ready(f"http://127.0.0.1:{port}/ready", group, timeout_s=30, cancel=cancel)


def test_a_child_dying_early_fails_startup_with_its_name_and_log_tail(group, echo, children):
    (port,) = pick_free_ports(1)
    group.start(ServiceLaunch("server", [PY, children["ready_server"], str(port), "1000"]))
    group.start(ServiceLaunch("crasher", [PY, children["crash"]]))
    with pytest.raises(ServiceDied) as info:
        wait_until_ready(f"http://127.0.0.1:{port}/ready", group, timeout_s=30, interval_s=0.05)
    died = info.value
    assert died.name == "crasher" and died.returncode == 3
    # A fork while this process has gRPC threads (earlier tests' channels) can leave one line
    # of gRPC core's own diagnostics ("E1201 ... ev_epoll1_linux.cc ...") at the top of the
    # child's log; the tail is the child's own lines after it.
    lines = [line for line in died.log_tail.splitlines() if not _GRPC_CORE_LINE.match(line)]
    assert lines == ["test crasher starting", "boom: simulated failure"]
    assert str(died).startswith("crasher exited with code 3; last lines of its log")
    assert "[crasher] boom: simulated failure" in echo.getvalue()
    assert group.processes["server"].alive  # stopping the rest is the caller's decision


def test_stop_terminates_workers_before_the_last_wave_and_kills_stragglers(
    group, children, tmp_path
):
    marker = tmp_path / "terminated.txt"
    sleeper = [PY, children["sleeper"], str(marker)]
    procs = [
        group.start(ServiceLaunch("coordinator", [*sleeper, "coordinator"], stop_last=True)),
        group.start(ServiceLaunch("w0", [*sleeper, "w0"])),
        group.start(ServiceLaunch("stubborn", [*sleeper, "stubborn", "--ignore-term"])),
        group.start(ServiceLaunch("w1", [*sleeper, "w1"])),
    ]
    for p in procs:
        _wait_for_log(p.log_path, "sleeping")
    start = time.monotonic()
    group.stop(grace_s=1.0)
    assert time.monotonic() - start < 5.0
    assert all(_gone(p.pid) for p in procs)
    order = marker.read_text().split()
    assert sorted(order[:2]) == ["w0", "w1"] and order[2:] == ["coordinator"]
    assert group.processes["stubborn"].returncode == -signal.SIGKILL
    assert group.processes["coordinator"].returncode == 0


def test_killing_the_launcher_with_sigkill_leaves_no_orphans(children, tmp_path):
    marker = tmp_path / "terminated.txt"
    log_dir = tmp_path / "parent-logs"
    parent = subprocess.Popen(
        [PY, children["launcher"], str(log_dir), children["sleeper"], str(marker)],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    try:
        pids = json.loads(parent.stdout.readline())
        for name in ("s0", "s1"):
            _wait_for_log(log_dir / f"{name}.log", "sleeping")
        assert not any(_gone(pid) for pid in pids)
        parent.kill()
        parent.wait(10)
        assert _wait_until(lambda: all(_gone(pid) for pid in pids), timeout_s=5.0)
        # They went because the kernel sent them SIGTERM (PR_SET_PDEATHSIG), not by accident.
        assert _wait_until(
            lambda: marker.exists() and sorted(marker.read_text().split()) == ["s0", "s1"], 2.0
        )
    finally:
        parent.kill()
        parent.wait(10)
        for pid in pids:  # only reached with live pids if the test already failed
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_start_local_stack_serves_until_stopped_and_cleans_up(monkeypatch, children, tmp_path):
    marker = tmp_path / "terminated.txt"

    def test_specs(config, config_path, coordinators=None):
        # The services replaced by test children; the resolved config they get is real.
        assert load_config(config_path) == config
        server = [PY, children["ready_server"], str(config.coordinator.port), "0.3"]
        sleeper = [PY, children["sleeper"], str(marker), "prefill-0"]
        return [
            ServiceLaunch("coordinator", server, stop_last=True),
            ServiceLaunch("prefill-0", sleeper),
        ]

    monkeypatch.setattr(stack_module, "service_launches", test_specs)
    config = parse_config({"coordinator": {"port": 0, "registry_port": 0}})
    with start_local_stack(config, startup_timeout_s=20, run_dir=tmp_path / "run") as stack:
        port = stack.config.coordinator.port
        assert port != 0 and stack.config.coordinator.registry_port not in (0, port)
        assert stack.base_url == f"http://127.0.0.1:{port}/v1"
        assert stack.registry_address == f"127.0.0.1:{stack.config.coordinator.registry_port}"
        assert probe(stack.ready_url)[0]
        assert set(stack.processes) == {"coordinator", "prefill-0"}
        assert stack.config_path.is_file()
        pids = [p.pid for p in stack.processes.values()]
        stack.check_alive()
    assert not stack.config_path.exists()
    assert all(_gone(pid) for pid in pids)
    assert (tmp_path / "run" / "coordinator.log").is_file()


def test_start_local_stack_stops_everything_when_a_service_dies(
    leftover_children, monkeypatch, children, tmp_path
):
    def test_specs(config, config_path, coordinators=None):
        server = [PY, children["ready_server"], str(config.coordinator.port), "1000"]
        return [
            ServiceLaunch("coordinator", server, stop_last=True),
            ServiceLaunch("decode-0", [PY, children["crash"]]),
        ]

    monkeypatch.setattr(stack_module, "service_launches", test_specs)
    config = parse_config({"coordinator": {"port": 0, "registry_port": 0}})
    run_dir = tmp_path / "run"
    with pytest.raises(ServiceDied, match="boom: simulated failure") as info:
        start_local_stack(config, startup_timeout_s=20, run_dir=run_dir)
    assert info.value.name == "decode-0"
    assert not (run_dir / "config.yaml").exists()
    assert leftover_children() == []  # the coordinator went too


def test_a_service_crashing_while_the_stack_starts_is_restarted(monkeypatch, children, tmp_path):
    marker = tmp_path / "terminated.txt"
    argv = [PY, children["sleeper"], str(marker), "decode-0"]
    sleeper = ServiceLaunch("decode-0", argv, ready=lambda: (True, "sleeping"))

    def test_specs(config, config_path, coordinators=None):
        server = [PY, children["ready_server"], str(config.coordinator.port), "0"]
        crash = [PY, "-c", "raise SystemExit(1)"]  # code 1: nothing a restart cannot fix
        return [
            ServiceLaunch("coordinator", server, stop_last=True),
            # Its first start never gets ready: it crashes.
            ServiceLaunch(
                "decode-0", crash, ready=lambda: (False, "starting"), renew=lambda: sleeper
            ),
        ]

    monkeypatch.setattr(stack_module, "service_launches", test_specs)
    config = parse_config({"coordinator": {"port": 0, "registry_port": 0}})
    with start_local_stack(config, startup_timeout_s=20, run_dir=tmp_path / "run") as stack:
        assert stack.supervisor.restarts("decode-0") == 1
        assert stack.processes["decode-0"].alive
        stack.check_alive()
    assert (tmp_path / "run" / "decode-0.log").read_text().startswith("--- splitserve: restart 1")


def test_resolve_config_picks_distinct_ports_and_shares_cores():
    config = parse_config(
        {
            "coordinator": {"port": 0, "registry_port": 0},
            "models": [
                {"id": "a", "pools": {"prefill": 2, "decode": 1}},
                {
                    "id": "b",
                    "pools": {"prefill": 0, "decode": 0, "both": 1},
                    "worker": {"threads": 3},
                },
            ],
        }
    )
    resolved = resolve_config(config, cpus=9)
    ports = (resolved.coordinator.port, resolved.coordinator.registry_port)
    assert 0 not in ports and ports[0] != ports[1]
    assert resolved.model("a").worker.threads == 2  # 9 cores // 4 workers
    assert resolved.model("b").worker.threads == 3  # set explicitly: kept
    assert resolve_config(config, cpus=1).model("a").worker.threads == 1
    fixed = parse_config({"coordinator": {"port": 8123, "registry_port": 50999}})
    assert resolve_ports(fixed) == fixed


def test_service_specs_start_the_coordinator_then_every_worker(tmp_path):
    config = resolve_config(
        parse_config(
            {
                "models": [
                    {"id": "a", "pools": {"prefill": 2, "decode": 1}},
                    {"id": "b", "pools": {"prefill": 0, "decode": 0, "both": 1}},
                ]
            }
        ),
        cpus=8,
    )
    path = tmp_path / "c.yaml"
    specs = service_launches(config, path)
    names = [s.name for s in specs]
    assert names == ["coordinator", "a/prefill-0", "a/prefill-1", "a/decode-0", "b/both-0"]
    assert [s.stop_last for s in specs] == [True, False, False, False, False]
    assert list(specs[0].argv) == [
        PY,
        "-m",
        "tools.cli",
        "serve",
        "coordinator",
        "--config",
        str(path),
    ]
    assert list(specs[2].argv[3:]) == [
        "serve",
        "prefill",
        "--config",
        str(path),
        "--model-id",
        "a",
        "--index",
        "1",
        "--port",
        specs[2].argv[-1],
    ]
    ports = {s.argv[-1] for s in specs[1:]}
    assert len(ports) == 4 and "0" not in ports  # the launcher knows where to ask for health
    assert specs[0].ready is not None and all(s.renew is not None for s in specs[1:])
    assert specs[1].renew().argv[-1] != specs[1].argv[-1]  # a restart gets a fresh port
    assert all(s.env["OMP_NUM_THREADS"] == "2" for s in specs)  # 8 cores // 4 workers
    assert all(s.env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO_ROOT) for s in specs)
    single = worker_slots(parse_config({}))
    assert [(w.name, w.role, w.index) for w in single] == [
        ("prefill-0", "prefill", 0),
        ("decode-0", "decode", 0),
    ]


def test_several_coordinators_get_their_own_ports_and_every_worker_registers_with_each(tmp_path):
    config = resolve_config(parse_config({"coordinator": {"replicas": 3}}), cpus=2)
    c = config.coordinator
    assert len(set(c.registry_endpoints)) == 3
    assert c.registry_endpoints[0] == f"127.0.0.1:{c.registry_port}"
    assert c.registries == c.registry_endpoints  # what every worker registers with
    slots = coordinator_slots(config)
    assert [s.name for s in slots] == ["coordinator", "coordinator-1", "coordinator-2"]
    assert [f"127.0.0.1:{s.registry_port}" for s in slots] == list(c.registry_endpoints)
    assert slots[0].port == c.port and len({s.port for s in slots}) == 3
    specs = service_launches(config, tmp_path / "c.yaml", slots)
    assert [s.name for s in specs[:3]] == ["coordinator", "coordinator-1", "coordinator-2"]
    assert all(s.stop_last for s in specs[:3])
    assert list(specs[2].argv[-4:]) == [
        "--port", str(slots[2].port), "--registry-port", str(slots[2].registry_port),
    ]  # fmt: skip
    assert "--port" not in specs[0].argv  # the first one's ports are the config's
    pinned = parse_config({"coordinator": {"replicas": 2, "registry_endpoints": ["a:1"]}})
    with pytest.raises(ConfigError, match="leave it empty with coordinator.replicas > 1"):
        resolve_config(pinned)


def test_group_refuses_two_services_with_one_name(group, children, tmp_path):
    group.start(ServiceLaunch("w", [PY, children["sleeper"], str(tmp_path / "m"), "w"]))
    with pytest.raises(ValueError, match="already"):
        group.start(ServiceLaunch("w", [PY, children["sleeper"], str(tmp_path / "m"), "w"]))


def _fake_services(monkeypatch, children, tmp_path, worker_argv):
    """Make the stack run a ready test server as coordinator and `worker_argv` as decode-0."""

    def test_specs(config, config_path, coordinators=None):
        server = [PY, children["ready_server"], str(config.coordinator.port), "0"]
        return [
            ServiceLaunch("coordinator", server, stop_last=True),
            ServiceLaunch("decode-0", worker_argv),
        ]

    monkeypatch.setattr(stack_module, "service_launches", test_specs)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # where `up` puts its run folder


def test_up_announces_the_stack_and_stops_cleanly_on_sigterm(
    leftover_children, monkeypatch, children, tmp_path
):
    _fake_services(
        monkeypatch, children, tmp_path, [PY, children["sleeper"], str(tmp_path / "m"), "d"]
    )
    out, err = io.StringIO(), io.StringIO()

    def terminate_once_ready():
        if _wait_until(lambda: "splitserve is ready" in out.getvalue(), timeout_s=30):
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_once_ready, daemon=True).start()
    handler_before = signal.getsignal(signal.SIGTERM)
    config = parse_config({"coordinator": {"port": 0, "registry_port": 0}})
    assert run_up(config, startup_timeout_s=30, out=out, err=err) == 0
    assert re.fullmatch(
        r"splitserve is ready: http://127\.0\.0\.1:\d+/v1 \(model: SmolLM2-135M-Instruct\)\n",
        out.getvalue(),
    )
    assert leftover_children() == []
    (run_dir,) = tmp_path.glob(f"splitserve-{os.getpid()}-*")
    assert f"logs: {run_dir}" in err.getvalue()
    assert re.search(r"playground: http://127\.0\.0\.1:\d+/playground/\n", err.getvalue())
    assert not (run_dir / "config.yaml").exists() and (run_dir / "decode-0.log").is_file()
    assert signal.getsignal(signal.SIGTERM) is handler_before  # the handler was put back


def test_up_fails_naming_a_service_that_dies_after_startup(
    leftover_children, monkeypatch, children, tmp_path
):
    go = tmp_path / "crash-now"
    _fake_services(monkeypatch, children, tmp_path, [PY, children["crash"], str(go)])
    out, err = io.StringIO(), io.StringIO()

    def crash_once_ready():
        if _wait_until(lambda: "splitserve is ready" in out.getvalue(), timeout_s=30):
            go.touch()

    threading.Thread(target=crash_once_ready, daemon=True).start()
    config = parse_config({"coordinator": {"port": 0, "registry_port": 0}})
    assert run_up(config, startup_timeout_s=30, out=out, err=err) == 1
    assert "splitserve is ready" in out.getvalue()
    # Code 3 (registration refused): starting it again would only be refused again.
    assert (
        "splitserve: error: decode-0 stopped unexpectedly (the coordinator refused its "
        "registration): exited with code 3"
    ) in err.getvalue()
    assert "boom: simulated failure" in err.getvalue()
    assert leftover_children() == []


def test_services_start_cleanly_while_grpc_threads_are_busy():
    """The launcher forks each service with a preexec_fn (die with the parent), so gRPC's fork
    handlers would run in the child before its exec; with this process's gRPC threads busy
    they aborted the child (9 of 60 starts measured). `splitserve` and this suite turn gRPC's
    fork support off before gRPC loads: every start must exit as its program says."""
    from concurrent import futures

    import grpc

    from services.launcher.processes import _die_with_parent_hook

    assert os.environ.get("GRPC_ENABLE_FORK_SUPPORT") == "0"
    server = grpc.server(futures.ThreadPoolExecutor(2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    done = threading.Event()

    def poll() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/splitserve.test.Nothing/Call")
            while not done.is_set():
                try:  # a real round trip each time (answered UNIMPLEMENTED)
                    call(b"", timeout=1.0)
                except grpc.RpcError:
                    pass

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        hook = _die_with_parent_hook()
        codes = [
            subprocess.run(
                [sys.executable, "-c", "raise SystemExit(3)"],
                preexec_fn=hook,
                check=False,
                timeout=60,  # with fork support on, a child could also hang before its exec
            ).returncode
            for _ in range(40)
        ]
    finally:
        done.set()
        poller.join(5)
        server.stop(None)
    assert codes == [3] * 40
