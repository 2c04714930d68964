"""The coordinator process: the OpenAI HTTP API and the worker registry, on one event loop."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

import uvicorn
import yaml
from pydantic import ValidationError

from services.coordinator.api.app import create_app
from services.coordinator.attempt.grpc_backend import GrpcBackend, reap_forever
from services.coordinator.generation_backend import ModelInfo
from services.coordinator.keys import ApiKey
from services.coordinator.playground.fleet import FleetView
from services.coordinator.playground.routes import PlaygroundSources
from services.coordinator.route.registry import WorkerRegistry
from services.coordinator.route.registry_service import RegistryService
from services.coordinator.settings import APISettings
from shared.config.policy import ApiKeyEntry
from shared.config.schema import ConfigError, DeploymentConfig
from shared.modelfile.default import default_model_path
from shared.modelfile.gguf_meta import read_gguf_config
from shared.modelfile.hf_config import read_hf_config
from shared.proto_gen import worker_pb2_grpc as pb_grpc
from shared.rpc import event_loop
from shared.rpc.auth import InternalAuth
from shared.telemetry.tracing import Tracing
from shared.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def model_infos(config: DeploymentConfig) -> list[ModelInfo]:
    infos = []
    for m in config.models:
        path = m.path or default_model_path()
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise ConfigError(
                f"models[{m.id}].path: the coordinator tokenizes for the model: a Hugging Face "
                "folder needs its tokenizer.json"
            )
        model_cfg = read_hf_config(path) if os.path.isdir(path) else read_gguf_config(path)
        context = min(m.max_model_len or model_cfg.max_position, model_cfg.max_position)
        tokenizer = Tokenizer.from_model_path(path)
        infos.append(
            ModelInfo(
                id=m.id,
                context_length=context,
                tokenizer=tokenizer,
                fingerprint=f"fp_{tokenizer.fingerprint[:10]}_{m.weights}",
            )
        )
    return infos


def api_keys(config: DeploymentConfig) -> tuple[str, ...]:
    path = config.coordinator.api_keys_file
    if not path:
        return ()
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"coordinator.api_keys_file: cannot read {path}: {exc}") from exc
    keys = tuple(line.strip() for line in lines if line.strip() and not line.startswith("#"))
    if not keys:
        raise ConfigError(f"coordinator.api_keys_file: {path} holds no keys")
    return keys


def keyed_api_keys(config: DeploymentConfig) -> tuple[ApiKey, ...]:
    """Keys with entitlements: `api_keys.keys` inline, then those in `api_keys.file` (YAML)."""
    entries = list(config.api_keys.keys)
    path = config.api_keys.file
    if path:
        try:
            raw = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"api_keys.file: cannot read {path}: {exc}") from exc
        if not isinstance(raw, list) or not raw:
            raise ConfigError(f"api_keys.file: {path} must hold a non-empty YAML list of keys")
        try:
            entries += [ApiKeyEntry.model_validate(item) for item in raw]
        except ValidationError as exc:
            problems = "; ".join(e["msg"] for e in exc.errors())
            raise ConfigError(f"api_keys.file: {path}: {problems}") from exc
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise ConfigError(f"api_keys: key names must be unique; got {names}")
    return tuple(ApiKey(e.name, e.key, e.default_tier, tuple(e.allowed_tiers)) for e in entries)


def check_policy(config: DeploymentConfig) -> None:
    """Cross-checks the schema cannot make alone: routers and limits name served models."""
    served = {m.id for m in config.models}
    for name, router in config.routers.items():
        unknown = sorted(router.referenced_models - served)
        if unknown:
            raise ConfigError(
                f"routers.{name}: models {unknown} are not served (served: {sorted(served)})"
            )
    unknown = sorted(set(config.tiers.max_in_flight_per_model) - served)
    if unknown:
        raise ConfigError(f"tiers.max_in_flight_per_model: unknown models {unknown}")


def api_settings(config: DeploymentConfig) -> APISettings:
    """The HTTP layer's settings from the deployment config, validated once here."""
    check_policy(config)
    c = config.coordinator
    return APISettings(
        model_id=config.models[0].id,
        max_body_bytes=c.max_body_bytes,
        max_tokens_limit=c.max_tokens_limit,
        default_max_tokens=min(c.default_max_tokens, c.max_tokens_limit),
        max_migrations=c.max_migrations,
        api_keys=api_keys(config),
        keys=keyed_api_keys(config),
        tiers=config.tiers,
        prices=dict(config.prices),
        saved_routers=dict(config.routers),
        playground_enabled=config.playground.enabled,
        training_log=config.capture.training_log if config.capture.training_log.enabled else None,
    )


def playground_sources(
    config: DeploymentConfig, tracing: Tracing, fleet: FleetView
) -> PlaygroundSources:
    """The fleet from the registry; traces from memory, plus the workers' spans from the
    trace file when every service of the deployment writes to the same one (a local stack)."""
    tail = None
    if tracing.recent is not None and config.telemetry.exporter == "file":
        from shared.telemetry.recent_traces import TraceFileTail  # the SDK is loaded: tracing

        tail = TraceFileTail(config.telemetry.file, tracing.recent, skip_pid=os.getpid())
        tail.start_at_end()
    return PlaygroundSources(fleet=fleet, traces=tracing.recent, trace_file=tail)


async def serve_coordinator(
    config: DeploymentConfig, bind_host: str | None = None, port: int | None = None
) -> None:
    """`bind_host` overrides where we listen (a pod binds 0.0.0.0 while workers dial the
    Service name in `coordinator.host`)."""
    infos = model_infos(config)
    check_policy(config)  # before binding anything: a bad policy should stop the start
    auth = InternalAuth.from_config(config)
    registry = WorkerRegistry(config, {i.id: i.tokenizer.fingerprint for i in infos})
    grpc_server = auth.server()
    pb_grpc.add_RegistryServicer_to_server(RegistryService(registry), grpc_server)
    c = config.coordinator
    host = bind_host or c.host
    auth.add_port(grpc_server, f"{host}:{c.registry_port}")
    await grpc_server.start()
    playground = config.playground
    tracing = Tracing.from_config(
        config.telemetry,
        "splitserve-coordinator",
        recent_traces=playground.recent_traces if playground.enabled else 0,
    )
    backend = GrpcBackend(registry, infos, config.transfer.deadline_s, tracing.tracer, auth)
    settings = api_settings(config)
    fleet = FleetView(registry, playground.fleet_refresh_s, auth)
    app = create_app(backend, settings, tracing, playground_sources(config, tracing, fleet))
    server = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port or c.port, log_level="warning", lifespan="on")
    )
    server.install_signal_handlers = lambda: None  # we own SIGTERM: drain, then stop
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    reaper = asyncio.create_task(reap_forever(registry, c.heartbeat_interval_s))
    log.info(
        "coordinator: HTTP on %s:%s, registry on %s:%s", c.host, c.port, c.host, c.registry_port
    )
    try:
        await server.serve()
    finally:
        reaper.cancel()
        await grpc_server.stop(grace=2.0)
        await fleet.close()
        await backend.close()
        await asyncio.to_thread(tracing.shutdown)


def run_coordinator(
    config: DeploymentConfig, bind_host: str | None = None, port: int | None = None
) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(message)s"
    )
    event_loop.run(serve_coordinator(config, bind_host, port))
