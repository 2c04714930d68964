"""The deployment config is validated once, at the edge, and a bad file is named precisely."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shared.config.schema import (
    ConfigError,
    DeploymentConfig,
    dump_config,
    load_config,
    parse_config,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, data: object, name: str = "deploy.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_defaults_validate_and_describe_a_servable_deployment():
    config = DeploymentConfig()
    assert config.block_size == 16
    assert [m.id for m in config.models] == ["SmolLM2-135M-Instruct"]
    assert config.num_workers == 2  # one prefill + one decode
    assert config.transfer.backend == "shm"
    assert config.coordinator.heartbeat_timeout_s > config.coordinator.heartbeat_interval_s
    assert load_config(None) == config


def test_empty_file_means_defaults(tmp_path):
    assert load_config(_write(tmp_path, "")) == DeploymentConfig()


def test_round_trip_through_dump_and_load(tmp_path):
    config = parse_config(
        {
            "block_size": 32,
            "models": [
                {"id": "a", "pools": {"prefill": 2, "decode": 1}, "worker": {"threads": 3}},
                {"id": "b", "weights": "int8", "pools": {"prefill": 0, "decode": 0, "both": 2}},
            ],
            "transfer": {"backend": "tcp", "deadline_s": 2.5},
            "coordinator": {"port": 0, "registry_port": 0, "heartbeat_timeout_s": 7.0},
        }
    )
    path = _write(tmp_path, dump_config(config))
    loaded = load_config(path)
    assert loaded == config
    assert loaded.model("b").pools.both == 2
    assert loaded.num_workers == 5


@pytest.mark.parametrize(
    ("data", "field", "problem"),
    [
        ({"models": [{"pools": {"prefill": 0, "decode": 1}}]}, "models.0.pools", "at least one"),
        ({"models": [{"pools": {"prefill": -1}}]}, "models.0.pools.prefill", "greater than"),
        ({"transfer": {"backend": "rdma"}}, "transfer.backend", "'shm'"),
        ({"block_size": 12}, "block_size", "power of two"),
        ({"coordinator": {"heartbeat_timeout_s": 0}}, "coordinator.heartbeat_timeout_s", "greater"),
        ({"coordinator": {"port": 70000}}, "coordinator.port", "less than"),
        ({"coordinator": {"prot": 8000}}, "coordinator.prot", "Extra inputs"),
        ({"blocksize": 16}, "blocksize", "Extra inputs"),
        ({"models": []}, "models", "at least 1"),
        ({"models": [{"id": "router/x"}]}, "models.0.id", "router/"),
    ],
)
def test_bad_field_is_refused_naming_file_and_field(tmp_path, data, field, problem):
    path = _write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {field}: ")
    assert problem in message


def test_heartbeat_timeout_not_above_interval_is_refused(tmp_path):
    path = _write(tmp_path, {"coordinator": {"heartbeat_interval_s": 2, "heartbeat_timeout_s": 2}})
    with pytest.raises(ConfigError, match="heartbeat_timeout_s must exceed heartbeat_interval_s"):
        load_config(path)


def test_repeated_model_ids_are_refused(tmp_path):
    path = _write(tmp_path, {"models": [{"id": "m"}, {"id": "m"}]})
    with pytest.raises(ConfigError, match="repeated: m"):
        load_config(path)


def test_invalid_yaml_is_refused(tmp_path):
    path = _write(tmp_path, "models: [unclosed\n")
    with pytest.raises(ConfigError, match=f"^{path}: not valid YAML"):
        load_config(path)


def test_top_level_must_be_a_mapping(tmp_path):
    path = _write(tmp_path, "- a\n- b\n")
    with pytest.raises(ConfigError, match=f"^{path}: the top level must be a mapping"):
        load_config(path)


def test_missing_file_is_refused(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=f"^{path}: config file does not exist"):
        load_config(path)


def _splitserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tools.cli", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "command", [["serve", "prefill"], ["serve", "coordinator"], ["up", "--port", "0"]]
)
def test_cli_refuses_a_bad_config_with_exit_code_2(tmp_path, command):
    path = _write(tmp_path, {"transfer": {"backend": "rdma"}}, name="bad.yaml")
    result = _splitserve(*command, "--config", str(path))
    assert result.returncode == 2, result.stderr
    assert f"splitserve: error: {path}: transfer.backend: " in result.stderr
    assert result.stdout == ""


def test_cli_refuses_a_missing_config_file(tmp_path):
    path = tmp_path / "missing.yaml"
    result = _splitserve("up", "--config", str(path))
    assert result.returncode == 2
    assert f"splitserve: error: {path}: config file does not exist" in result.stderr


def test_serve_refuses_a_model_the_config_does_not_have(tmp_path):
    path = _write(tmp_path, {"models": [{"id": "a"}, {"id": "b"}]})
    unknown = _splitserve("serve", "decode", "--config", str(path), "--model-id", "c")
    assert unknown.returncode == 2
    assert "--model-id 'c' is not in" in unknown.stderr and "models: a, b" in unknown.stderr
    ambiguous = _splitserve("serve", "decode", "--config", str(path))
    assert ambiguous.returncode == 2
    assert "--model-id is required" in ambiguous.stderr
