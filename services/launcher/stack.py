"""A whole deployment on one machine: the coordinator and every worker as separate processes.

`start_local_stack` is what `splitserve up` runs, and what tests and benchmarks use to compare
deployments (e.g. two `both` replicas against one prefill and one decode replica).
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path
from typing import TextIO

import services
from services.launcher.internal_tls import remove_internal_tls, with_internal_tls
from services.launcher.internal_token import TOKEN_FILE, with_internal_token
from services.launcher.ports import pick_free_ports, resolve_ports
from services.launcher.processes import ProcessGroup, ServiceLaunch, ServiceProcess
from services.launcher.readiness import health_probe, probe, wait_until_ready
from services.launcher.supervisor import ServiceGaveUp, Supervisor
from shared.config.roles import WORKER_ROLES, WorkerRole
from shared.config.schema import ConfigError, DeploymentConfig, dump_config
from shared.rpc.auth import InternalAuth

COORDINATOR = "coordinator"
_SERVE = (sys.executable, "-m", "tools.cli", "serve")
_ANY_ADDRESS = {"", "0.0.0.0", "::"}


@dataclass(frozen=True)
class WorkerSlot:
    """One worker process of the stack. Names are `prefill-0`; `<model>/prefill-0` if several."""

    model_id: str
    role: WorkerRole
    index: int
    name: str


@dataclass(frozen=True)
class CoordinatorSlot:
    """One coordinator process: `coordinator`, then `coordinator-1`, … when there are several."""

    name: str
    host: str  # where to connect to it
    port: int  # HTTP
    registry_port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def coordinator_slots(config: DeploymentConfig) -> list[CoordinatorSlot]:
    """Every coordinator of a resolved config; the extra ones' HTTP ports are chosen now (the
    workers need only their registry ports, which the config lists)."""
    c = config.coordinator
    host = _connect_host(c.host)
    slots = [CoordinatorSlot(COORDINATOR, host, c.port, c.registry_port)]
    if c.replicas > 1:
        http_ports = pick_free_ports(c.replicas - 1, host)
        for i, (endpoint, port) in enumerate(
            zip(c.registry_endpoints[1:], http_ports, strict=True), 1
        ):
            registry_port = int(endpoint.rpartition(":")[2])
            slots.append(CoordinatorSlot(f"{COORDINATOR}-{i}", host, port, registry_port))
    return slots


def worker_slots(config: DeploymentConfig) -> list[WorkerSlot]:
    several = len(config.models) > 1
    slots = []
    for model in config.models:
        for role in WORKER_ROLES:
            for index in range(getattr(model.pools, role)):
                name = f"{role}-{index}"
                slots.append(
                    WorkerSlot(model.id, role, index, f"{model.id}/{name}" if several else name)
                )
    return slots


def available_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):  # honours taskset / cpuset limits, unlike cpu_count
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def default_threads(config: DeploymentConfig, cpus: int | None = None) -> int:
    """Torch threads per worker when the config leaves them unset: the cores, shared out."""
    return max(1, (cpus or available_cpus()) // max(1, config.num_workers))


def resolve_config(config: DeploymentConfig, cpus: int | None = None) -> DeploymentConfig:
    """Fill in what the config leaves to the launcher: free ports and per-worker threads.

    The result is written to the file every child reads, so nothing below the launcher has to
    guess (or re-read the environment) to get the same answer.
    """
    host = _connect_host(config.coordinator.host)
    config = resolve_ports(config, host)
    c = config.coordinator
    if c.replicas > 1:
        if c.registry_endpoints:
            raise ConfigError(
                "coordinator.registry_endpoints: leave it empty with coordinator.replicas > 1 "
                "(splitserve up lists the registries of the coordinators it starts)"
            )
        extra = pick_free_ports(c.replicas - 1, host)
        endpoints = [f"{host}:{c.registry_port}", *(f"{host}:{p}" for p in extra)]
        update = {"registry_endpoints": tuple(endpoints)}
        config = config.model_copy(update={"coordinator": c.model_copy(update=update)})
    threads = default_threads(config, cpus)
    models = [
        m
        if m.worker.threads is not None
        else m.model_copy(update={"worker": m.worker.model_copy(update={"threads": threads})})
        for m in config.models
    ]
    return config.model_copy(update={"models": models})


def service_launches(
    config: DeploymentConfig,
    config_path: Path,
    coordinators: list[CoordinatorSlot] | None = None,
) -> list[ServiceLaunch]:
    """The coordinators first, then every worker; `config` must already be resolved."""
    return [
        *(
            coordinator_spec(config, config_path, c)
            for c in coordinators or coordinator_slots(config)
        ),
        *(worker_spec(config, config_path, slot) for slot in worker_slots(config)),
    ]


def coordinator_spec(
    config: DeploymentConfig, config_path: Path, slot: CoordinatorSlot
) -> ServiceLaunch:
    # The coordinator does no tensor work; it only has to stay out of the workers' cores.
    threads = min(m.worker.threads or default_threads(config) for m in config.models)
    argv = [*_SERVE, COORDINATOR, "--config", str(config_path)]
    if slot.name != COORDINATOR:  # the first one's ports are the config's own
        argv += ["--port", str(slot.port), "--registry-port", str(slot.registry_port)]
    return ServiceLaunch(
        slot.name,
        argv,
        _child_env(threads),
        stop_last=True,
        ready=partial(probe, f"{slot.url}/health"),
    )


def worker_spec(config: DeploymentConfig, config_path: Path, slot: WorkerSlot) -> ServiceLaunch:
    """One worker on a port chosen now, so the launcher can ask its health service whether
    it serves; each restart takes a fresh port (the registry replaces the entry)."""
    host = _connect_host(config.worker_host)
    (port,) = pick_free_ports(1, host)
    argv = [*_SERVE, slot.role, "--config", str(config_path)]
    argv += ["--model-id", slot.model_id, "--index", str(slot.index), "--port", str(port)]
    threads = config.model(slot.model_id).worker.threads or default_threads(config)
    return ServiceLaunch(
        slot.name,
        argv,
        _child_env(threads),
        ready=partial(health_probe, f"{host}:{port}", InternalAuth.from_config(config)),
        renew=partial(worker_spec, config, config_path, slot),
    )


def _child_env(threads: int) -> dict[str, str]:
    # Workers share the machine: an OpenMP pool sized to every core in each of them
    # oversubscribes small machines badly (measured: torch ops 100x slower).
    env = {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    # `-m tools.cli` must resolve to this checkout even when the launcher runs elsewhere.
    root = str(Path(services.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return env


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in _ANY_ADDRESS else host


def default_run_dir() -> Path:
    """A fresh `splitserve-<pid>-*` folder under $XDG_RUNTIME_DIR, or the temp dir."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = runtime if runtime and os.access(runtime, os.W_OK) else tempfile.gettempdir()
    return Path(tempfile.mkdtemp(prefix=f"splitserve-{os.getpid()}-", dir=base))


class LocalStack:
    """A running local deployment. Use as a context manager, or call `stop()`."""

    def __init__(
        self,
        config: DeploymentConfig,
        run_dir: Path,
        config_path: Path,
        group: ProcessGroup,
        coordinators: list[CoordinatorSlot] | None = None,
    ):
        self.config = config  # resolved: real ports, threads filled in
        self.run_dir = run_dir
        self.config_path = config_path
        self.group = group
        self.coordinators = coordinators or coordinator_slots(config)
        self.workers = worker_slots(config)
        self.supervisor: Supervisor | None = None  # set once started, if supervised
        self._stopped = False

    @property
    def host(self) -> str:
        return _connect_host(self.config.coordinator.host)

    @property
    def url(self) -> str:
        """The coordinator's root (health, ready, metrics live here)."""
        return f"http://{self.host}:{self.config.coordinator.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible API root, e.g. http://127.0.0.1:8000/v1."""
        return f"http://{self.host}:{self.config.coordinator.port}/v1"

    @property
    def ready_url(self) -> str:
        return f"http://{self.host}:{self.config.coordinator.port}/ready"

    @property
    def coordinator_urls(self) -> list[str]:
        """Every coordinator's root, the first one (`url`) first."""
        return [c.url for c in self.coordinators]

    @property
    def registry_address(self) -> str:
        return f"{self.host}:{self.config.coordinator.registry_port}"

    @property
    def processes(self) -> dict[str, ServiceProcess]:
        return self.group.processes

    @cached_property
    def internal_auth(self) -> InternalAuth:
        """What a call to one of the stack's services must carry (tests, benchmarks)."""
        return InternalAuth.from_config(self.config)

    @property
    def failure(self) -> ServiceGaveUp | None:
        """Why the supervisor gave up on a service; None while it keeps the stack serving."""
        return self.supervisor.failure if self.supervisor is not None else None

    def supervise(self, started: bool = True) -> None:
        """From now on a service that dies is restarted (see services/launcher/supervisor)."""
        self.supervisor = Supervisor(self.group, started=started).start()

    def check_alive(self) -> None:
        """Raise ServiceDied if a service is gone for good: one the supervisor gave up on,
        or, without supervision, any service that exited."""
        if self.supervisor is None:
            self.group.check_alive()
        elif self.failure is not None:
            raise self.failure

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM workers, then the coordinator; SIGKILL what is left after `grace_s`."""
        if self._stopped:
            return
        self._stopped = True
        try:
            if self.supervisor is not None:
                self.supervisor.halt()
            self.group.stop(grace_s)
        finally:
            if self.supervisor is not None:
                self.supervisor.close()
            self.config_path.unlink(missing_ok=True)
            (self.run_dir / TOKEN_FILE).unlink(missing_ok=True)
            remove_internal_tls(self.run_dir)

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_local_stack(
    config: DeploymentConfig,
    startup_timeout_s: float = 300.0,
    *,
    run_dir: Path | None = None,
    echo: TextIO | None = None,
    cancel: threading.Event | None = None,
    supervise: bool = True,
    tls: bool = False,
) -> LocalStack:
    """Start every service of `config` and return once the coordinator reports ready and
    every worker's health service says SERVING.

    Logs go to `<run_dir>/<service>.log` (and to `echo`, prefixed, if given). If a service
    exits first, the timeout passes, or `cancel` is set, everything is stopped and
    ServiceDied / StartupTimeout / StartupCancelled is raised. Supervised (the default), a
    service that dies is restarted, while starting too: ServiceDied then means one that keeps
    failing to start or refused to (ServiceGaveUp); `supervise=False`: any exit is final, for
    tests that need a killed worker to stay gone. `tls`: internal calls are mutual TLS under
    a CA made for this run (unless the config names certificates of its own).
    """
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = with_internal_token(resolve_config(config), run_dir)
    if tls:
        resolved = with_internal_tls(resolved, run_dir)
    config_path = run_dir / "config.yaml"
    config_path.write_text(dump_config(resolved))
    coordinators = coordinator_slots(resolved)
    stack = LocalStack(resolved, run_dir, config_path, ProcessGroup(run_dir, echo), coordinators)
    try:
        for launch in service_launches(resolved, config_path, coordinators):
            stack.group.start(launch)
        if supervise:  # from the first start: a crash while starting is retried too
            stack.supervise(started=False)
        # Every coordinator ready: each one can route (workers register with each).
        for url in stack.coordinator_urls:
            wait_until_ready(
                f"{url}/ready",
                stack.group,
                startup_timeout_s,
                cancel=cancel,
                check=stack.check_alive,
            )
    except BaseException:
        stack.stop()
        raise
    return stack
