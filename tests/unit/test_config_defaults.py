"""One source of defaults: every knob the deployment schema and `EngineConfig` share defaults
to the same value, except the named library exceptions in shared/config/engine_defaults.py."""

import dataclasses

from engine.core.config import EngineConfig
from shared.config import engine_defaults as defaults
from shared.config.schema import DeploymentConfig, ModelDeployment, WorkerConfig
from shared.config.speculative import SpeculativeConfig

# EngineConfig field -> (schema model, its field name), for fields whose names differ.
RENAMED = {
    "model": (ModelDeployment, "path"),
    "num_threads": (WorkerConfig, "threads"),
    "speculative_method": (SpeculativeConfig, "method"),
}
SAME_NAME_IN = (DeploymentConfig, ModelDeployment, WorkerConfig, SpeculativeConfig)
# Engine-only knobs: the schema has no counterpart (a replica sizes its pool by bytes, picks its
# device and seed itself).
ENGINE_ONLY = {"num_blocks", "device", "seed"}
# Intentional differences, each named in engine_defaults with its reason.
LIBRARY_EXCEPTIONS = {
    "host_cache_bytes": (defaults.LIBRARY_HOST_CACHE_BYTES, defaults.HOST_CACHE_BYTES),
    "weights": (defaults.LIBRARY_WEIGHTS, defaults.WEIGHTS),
    "kv_cache_dtype": (defaults.LIBRARY_KV_CACHE_DTYPE, defaults.KV_CACHE_DTYPE),
}


def _schema_default(engine_field: str) -> object:
    if engine_field in RENAMED:
        model, name = RENAMED[engine_field]
        return model.model_fields[name].default
    owners = [m for m in SAME_NAME_IN if engine_field in m.model_fields]
    assert len(owners) == 1, f"{engine_field}: found in {owners}"
    return owners[0].model_fields[engine_field].default


def _engine_defaults() -> dict[str, object]:
    return {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def test_every_engine_knob_has_a_schema_counterpart_or_is_named_engine_only():
    unmatched = {
        name
        for name in _engine_defaults()
        if name not in RENAMED and not any(name in m.model_fields for m in SAME_NAME_IN)
    }
    assert unmatched == ENGINE_ONLY


def test_shared_knobs_default_alike_except_the_named_library_exceptions():
    differing = {}
    for name, engine_default in _engine_defaults().items():
        if name in ENGINE_ONLY:
            continue
        schema_default = _schema_default(name)
        if engine_default != schema_default:
            differing[name] = (engine_default, schema_default)
    assert differing == LIBRARY_EXCEPTIONS


def test_the_exceptions_are_real_differences():
    # A library engine keeps the KV host tier off and loads fp32; a served replica does not.
    assert defaults.LIBRARY_HOST_CACHE_BYTES == 0 < defaults.HOST_CACHE_BYTES
    assert EngineConfig().host_cache_bytes == 0
    assert WorkerConfig().host_cache_bytes == 512 * 1024**2
    assert (EngineConfig().weights, ModelDeployment().weights) == ("fp32", "auto")


def test_a_parsed_deployment_gets_the_shared_defaults():
    config = DeploymentConfig()
    worker = config.models[0].worker
    assert config.block_size == EngineConfig().block_size == defaults.BLOCK_SIZE
    assert worker.kv_cache_bytes == EngineConfig().kv_cache_bytes == defaults.KV_CACHE_BYTES
    assert worker.background_chunk_tokens == EngineConfig().background_chunk_tokens
