"""One validated schema for a deployment: what `splitserve up` reads and the Helm chart renders.

Validated once, at the edge (pydantic, unknown keys refused so a typo is an error, not a
silently ignored setting). Nothing below re-parses environment variables.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shared.config import engine_defaults as defaults
from shared.config.engine_defaults import KVCacheDtype, PreemptionMode
from shared.config.faults import FaultInjection
from shared.config.policy import ApiKeysConfig, ModelRoutesConfig, Prices, ServiceTiersConfig
from shared.config.router import RouterConfig
from shared.config.speculative import SpeculativeConfig

TransferBackendName = Literal["shm", "tcp", "nixl", "fake"]
WeightsName = Literal["fp32", "bf16", "int8", "int4", "native", "native-a8", "auto"]
ExporterName = Literal["none", "file", "otlp_grpc", "otlp_http"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PoolsConfig(_Strict):
    """Replica counts per role for one model (the chart can derive them from a ratio)."""

    prefill: int = Field(1, ge=0)
    decode: int = Field(1, ge=0)
    both: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _servable(self) -> PoolsConfig:
        if self.both == 0 and (self.prefill == 0 or self.decode == 0):
            raise ValueError(
                "a model needs at least one 'both' replica, or at least one prefill and one "
                "decode replica"
            )
        return self


class WorkerConfig(_Strict):
    kv_cache_bytes: int = Field(defaults.KV_CACHE_BYTES, gt=0)
    kv_cache_dtype: KVCacheDtype = Field(
        defaults.KV_CACHE_DTYPE,
        description="KV pool element type; auto = fp16 where the hardware converts it",
    )
    host_cache_bytes: int = Field(defaults.HOST_CACHE_BYTES, ge=0)
    disk_cache_bytes: int = Field(defaults.DISK_CACHE_BYTES, ge=0)
    disk_cache_dir: str | None = None
    max_num_batched_tokens: int = Field(defaults.MAX_NUM_BATCHED_TOKENS, ge=1)
    background_chunk_tokens: int | None = Field(
        defaults.BACKGROUND_CHUNK_TOKENS,
        ge=1,
        description="prompt tokens per step for flex/batch requests; None = no cap",
    )
    chunk_tokens_while_decoding: int | None = Field(
        defaults.CHUNK_TOKENS_WHILE_DECODING,
        ge=1,
        description="prompt tokens per step while replies stream (bounds ITL); None = no cap",
    )
    max_num_seqs: int = Field(defaults.MAX_NUM_SEQS, ge=1)
    threads: int | None = Field(None, ge=1, description="torch threads; default: cores / workers")
    preemption_mode: PreemptionMode = defaults.PREEMPTION_MODE
    fault_injection: FaultInjection = FaultInjection()  # test-only; off by default


class ModelDeployment(_Strict):
    id: str = "SmolLM2-135M-Instruct"
    path: str | None = Field(None, description="GGUF file or HF folder; None = bundled SmolLM2")
    # bf16 passed the quality gate for the bundled model (report shipped in engine/quality/reports).
    weights: WeightsName = defaults.WEIGHTS
    max_model_len: int | None = Field(None, ge=16)
    pools: PoolsConfig = PoolsConfig()
    worker: WorkerConfig = WorkerConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()

    @field_validator("id")
    @classmethod
    def _id_shape(cls, v: str) -> str:
        if not v.strip() or v.startswith("router/"):
            raise ValueError("model id must be non-empty and must not start with 'router/'")
        return v


class TransferConfig(_Strict):
    backend: TransferBackendName = "shm"
    deadline_s: float = Field(10.0, gt=0)


class CoordinatorConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    registry_port: int = Field(50151, ge=0, le=65535, description="gRPC registration endpoint")
    max_body_bytes: int = Field(4 * 1024**2, gt=0)
    max_tokens_limit: int = Field(4096, ge=1)
    default_max_tokens: int = Field(256, ge=1)
    heartbeat_interval_s: float = Field(1.0, gt=0)
    heartbeat_timeout_s: float = Field(5.0, gt=0)
    api_keys_file: str | None = Field(None, description="one key per line; none = no auth")
    max_migrations: int = Field(
        2, ge=0, description="moves of one stream to another decode replica before giving up"
    )
    replicas: int = Field(
        1, ge=1, description="coordinator processes `splitserve up` runs (the chart: its own)"
    )
    registry_endpoints: tuple[str, ...] = Field(
        (),
        description="host:port of the coordinators' registry; every worker registers with "
        "every address each one resolves to (a headless Service: every pod), re-resolved "
        "every registry_resolve_interval_s. Empty: host:registry_port",
    )
    registry_resolve_interval_s: float = Field(
        5.0, gt=0, description="how often workers look the registry endpoints up again"
    )

    @model_validator(mode="after")
    def _timeouts(self) -> CoordinatorConfig:
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("heartbeat_timeout_s must exceed heartbeat_interval_s")
        return self

    @field_validator("registry_endpoints")
    @classmethod
    def _host_port(cls, endpoints: tuple[str, ...]) -> tuple[str, ...]:
        for endpoint in endpoints:
            host, _, port = endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) <= 65535:
                raise ValueError(f"{endpoint!r} is not host:port")
        return endpoints

    @property
    def registries(self) -> tuple[str, ...]:
        """What workers register with (each entry may resolve to several coordinators)."""
        return self.registry_endpoints or (f"{self.host}:{self.registry_port}",)


class InternalTlsConfig(_Strict):
    """Mutual TLS on every internal gRPC call, with certificates from the deployment's own CA
    (shared/rpc/tls.py). The files are read and checked when a service starts."""

    enabled: bool = False
    ca_file: str | None = Field(None, description="PEM: the deployment CA every peer must chain to")
    cert_file: str | None = Field(
        None, description="PEM: this service's certificate (server and client auth), CA-signed"
    )
    key_file: str | None = Field(None, description="PEM: the private key of cert_file")
    server_name: str | None = Field(
        None,
        description="the name clients check servers' certificates for; None: the host they "
        "dial. The chart sets one, since workers are dialled by pod IP",
    )
    health_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="a plaintext port on each worker serving only grpc.health.v1, for probes "
        "that cannot speak TLS (the kubelet's gRPC probe); None: health on the TLS port only",
    )

    @model_validator(mode="after")
    def _files_named(self) -> InternalTlsConfig:
        if self.enabled:
            missing = [k for k in ("ca_file", "cert_file", "key_file") if not getattr(self, k)]
            if missing:
                raise ValueError(
                    f"TLS is enabled without {', '.join(missing)}: name the deployment CA, "
                    "this service's certificate and its key (`splitserve up --tls` makes a "
                    "set per run; the chart mounts them from a Secret or cert-manager)"
                )
        return self


class InternalAuthConfig(_Strict):
    """How the deployment's services authenticate each other (shared/rpc/auth.py)."""

    token_file: str | None = Field(
        None,
        description="file holding the shared token every internal gRPC call and KV-transfer "
        "handshake must carry (UNAUTHENTICATED otherwise); None: internal calls are not "
        "authenticated. `splitserve up` writes one per run; the chart mounts a Secret",
    )
    tls: InternalTlsConfig = InternalTlsConfig()


class TelemetryConfig(_Strict):
    """Where traces go. Metrics are always on (every service serves /metrics)."""

    exporter: ExporterName = "none"
    endpoint: str | None = Field(
        None, description="OTLP collector; default localhost:4317 (gRPC) or :4318/v1/traces"
    )
    file: str = Field("splitserve-traces.jsonl", description="JSON-lines file (exporter: file)")
    sampling_ratio: float = Field(1.0, ge=0.0, le=1.0, description="errors are always kept")
    capture_content: bool = Field(False, description="put prompt and completion text on spans")
    export_queue_size: int = Field(2048, ge=1, description="spans beyond this are dropped")
    export_timeout_s: float = Field(5.0, gt=0)
    worker_metrics_port: int = Field(
        0, ge=0, le=65535, description="workers' /metrics port; 0 = free port, sent at registration"
    )


class TrainingLogConfig(_Strict):
    """Finished requests as token ids, for training a draft on this deployment's traffic
    (shared/training_log.py). Off by default: see README, consent and retention."""

    enabled: bool = Field(False, description="log finished requests' token ids (opt-in)")
    path: str = Field(
        "splitserve-training-log.jsonl",
        description="JSON-lines file, appended; {host} becomes the host name (a file per "
        "coordinator on a shared volume)",
    )
    sample_ratio: float = Field(
        1.0, ge=0.0, le=1.0, description="fraction of finished requests logged"
    )

    @field_validator("path")
    @classmethod
    def _one_placeholder(cls, v: str) -> str:
        # Any other brace would be written literally into a file name: a typo of {host}.
        rest = v.replace("{host}", "")
        if "{" in rest or "}" in rest:
            raise ValueError(
                f"the only placeholder a training-log path may hold is {{host}}: {v!r}"
            )
        if not v.strip():
            raise ValueError("training-log path is empty")
        return v


class CaptureConfig(_Strict):
    """What the coordinator may keep of the traffic it serves, beyond metrics and spans."""

    training_log: TrainingLogConfig = TrainingLogConfig()


class PlaygroundConfig(_Strict):
    """The browser playground the coordinator serves at /playground (static files; every
    call it makes goes through the authenticated API)."""

    enabled: bool = Field(True, description="serve /playground and its fleet/trace JSON")
    recent_traces: int = Field(
        200, ge=1, description="finished traces kept in memory for its waterfall (oldest go)"
    )
    fleet_refresh_s: float = Field(
        1.0, gt=0, description="a fleet snapshot is reused this long, however many tabs poll"
    )


class DeploymentConfig(_Strict):
    block_size: int = Field(
        defaults.BLOCK_SIZE, description="tokens per KV block; router and workers must agree"
    )
    models: list[ModelDeployment] = Field(default_factory=lambda: [ModelDeployment()], min_length=1)
    transfer: TransferConfig = TransferConfig()
    coordinator: CoordinatorConfig = CoordinatorConfig()
    worker_host: str = "127.0.0.1"
    worker_drain_grace_s: float = Field(
        30.0,
        gt=0,
        description="on SIGTERM a worker's running streams get this long to finish; the "
        "decode streams still running then are handed over to another decode replica (the "
        "chart's terminationGracePeriodSeconds covers it, the preStop pause and the hand-over)",
    )
    telemetry: TelemetryConfig = TelemetryConfig()
    internal_auth: InternalAuthConfig = InternalAuthConfig()
    tiers: ServiceTiersConfig = ServiceTiersConfig()
    api_keys: ApiKeysConfig = ApiKeysConfig()
    prices: Prices = Field(default_factory=dict, validate_default=True)
    routers: ModelRoutesConfig = Field(default_factory=dict)
    router: RouterConfig = RouterConfig()
    playground: PlaygroundConfig = PlaygroundConfig()
    capture: CaptureConfig = CaptureConfig()

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v <= 0 or v & (v - 1):
            raise ValueError("block_size must be a positive power of two")
        return v

    @model_validator(mode="after")
    def _unique_ids(self) -> DeploymentConfig:
        ids = [m.id for m in self.models]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"model ids must be unique; repeated: {', '.join(dupes)}")
        return self

    def model(self, model_id: str) -> ModelDeployment:
        for m in self.models:
            if m.id == model_id:
                return m
        raise KeyError(model_id)

    @property
    def num_workers(self) -> int:
        return sum(m.pools.prefill + m.pools.decode + m.pools.both for m in self.models)


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the field."""


def load_config(path: str | Path | None) -> DeploymentConfig:
    if path is None:
        return DeploymentConfig()
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: config file does not exist") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    return parse_config(raw, str(path))


def parse_config(raw: object, origin: str = "<config>") -> DeploymentConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{origin}: the top level must be a mapping")
    try:
        return DeploymentConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(f"{origin}: {problems}") from exc


def dump_config(config: DeploymentConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
