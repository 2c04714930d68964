"""The rendered config.yaml is the project's own schema, and pool sizes come out right."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import yaml

from shared.config.schema import parse_config
from tests.chart.conftest import VALUE_SETS, helm_template, render

REGISTRY_HOST = "rel-splitserve-coordinator-registry.serving.svc"


def pool_replicas(rendered, model_slug: str, role: str) -> int:
    return rendered.get("Deployment", f"rel-splitserve-{model_slug}-{role}")["spec"]["replicas"]


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_config_yaml_validates_with_the_projects_schema(value_set):
    rendered = render(value_set)
    config = parse_config(yaml.safe_load(rendered.config_yaml()), f"{value_set}: config.yaml")
    # Workers dial the coordinator through the registry Service, which lists coordinators
    # before they are ready (they become ready only once workers registered).
    assert config.coordinator.host == REGISTRY_HOST
    registry = rendered.get("Service", "rel-splitserve-coordinator-registry")
    assert registry["spec"]["publishNotReadyAddresses"] is True
    # Headless: the name resolves to every coordinator pod, and workers register with each.
    assert registry["spec"]["clusterIP"] == "None"
    assert config.coordinator.registries == (f"{REGISTRY_HOST}:{config.coordinator.registry_port}",)
    assert registry["spec"]["ports"][0]["port"] == config.coordinator.registry_port
    coordinator = rendered.get("Deployment", "rel-splitserve-coordinator")
    ports = {p["name"]: p["containerPort"] for p in _container(coordinator)["ports"]}
    assert ports == {"http": config.coordinator.port, "registry": config.coordinator.registry_port}
    assert config.transfer.backend in ("tcp", "nixl")


def test_config_carries_the_models_and_their_engine_settings():
    config = parse_config(yaml.safe_load(render("two-models").config_yaml()))
    assert [m.id for m in config.models] == ["SmolLM2-135M-Instruct", "llama-3.1-8b-instruct"]
    small, big = config.models
    assert (small.weights, small.max_model_len, small.worker.kv_cache_bytes) == (
        "int4", 4096, 1024**3,
    )  # fmt: skip
    assert small.worker.max_num_seqs == 128 and big.worker.preemption_mode == "swap"
    assert big.path == "/models/llama-3.1-8b-instruct.Q4_K_M.gguf"
    assert (config.block_size, config.transfer.backend, config.transfer.deadline_s) == (
        32, "nixl", 5.0,
    )  # fmt: skip


@pytest.mark.parametrize("value_set", ["default", "two-models", "existing-secret"])
def test_without_the_planner_config_pools_are_the_deployments_sizes(value_set):
    rendered = render(value_set)
    config = parse_config(yaml.safe_load(rendered.config_yaml()))
    for model in config.models:
        slug = _slug(model.id)
        assert model.pools.prefill == pool_replicas(rendered, slug, "prefill")
        assert model.pools.decode == pool_replicas(rendered, slug, "decode")
        assert model.pools.both == 0


def test_with_the_planner_config_pools_are_its_minimums_and_deployments_start_at_the_ratio():
    rendered = render("planner")
    config = parse_config(yaml.safe_load(rendered.config_yaml()))
    floors = {m.id: (m.pools.prefill, m.pools.decode) for m in config.models}
    assert floors == {"SmolLM2-135M-Instruct": (1, 1), "qwen2.5-0.5b": (2, 2)}
    assert pool_replicas(rendered, "smollm2-135m-instruct", "prefill") == 2  # 6 at 1:2
    assert pool_replicas(rendered, "qwen2-5-0-5b", "decode") == 3  # 5 at 2:3


# (total, ratio) -> (prefill, decode): prefill = total * a / (a + b) rounded half up, at
# least 1 and at most total - 1.
RATIO_CASES = [
    (4, "1:3"), (8, "1:3"), (5, "2:3"), (2, "1:9"), (10, "9:1"), (7, "1:1"), (3, "1:1"),
    (100, "1:7"), (6, "1:2"), (9, "2:7"), (12, "5:7"), (3, "3:1"),
]  # fmt: skip


def expected_split(total: int, ratio: str) -> tuple[int, int]:
    a, b = (int(x) for x in ratio.split(":"))
    prefill = math.floor(Fraction(total * a, a + b) + Fraction(1, 2))
    prefill = max(1, min(total - 1, prefill))
    return prefill, total - prefill


def test_replica_counts_from_total_and_ratio(tmp_path):
    models = [{"id": f"m{i}"} for i in range(len(RATIO_CASES))]
    pools = {f"m{i}": {"total": t, "ratio": r} for i, (t, r) in enumerate(RATIO_CASES)}
    values = tmp_path / "ratios.yaml"
    values.write_text(yaml.safe_dump({"models": models, "pools": pools}))
    done = helm_template("-f", str(values))
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    sizes = {
        d["metadata"]["name"]: d["spec"]["replicas"]
        for d in docs
        if d["kind"] == "Deployment" and "coordinator" not in d["metadata"]["name"]
    }
    for i, (total, ratio) in enumerate(RATIO_CASES):
        got = (sizes[f"rel-splitserve-m{i}-prefill"], sizes[f"rel-splitserve-m{i}-decode"])
        assert got == expected_split(total, ratio), f"total {total} at {ratio}"
        assert sum(got) == total


def test_the_reference_split_is_what_the_issue_means_by_a_ratio():
    assert expected_split(4, "1:3") == (1, 3)
    assert expected_split(8, "1:3") == (2, 6)
    assert expected_split(2, "1:9") == (1, 1)  # both pools always exist


def _container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def _slug(model_id: str) -> str:
    import re

    return re.sub(r"[^a-z0-9]+", "-", model_id.lower()).strip("-")[:22].rstrip("-")


def test_policy_sections_reach_the_config():
    config = parse_config(yaml.safe_load(render("policy").config_yaml()))
    assert config.telemetry.exporter == "otlp_grpc"
    assert config.telemetry.endpoint == "otel-collector.observability:4317"
    assert config.router.local_prefill_max_tokens == 128
    assert config.tiers.max_in_flight == 48 and config.tiers.flex.max_wait_s == 60
    assert config.prices["priority"].output == 1.2
    assert config.prices["batch"].output > 0  # tiers left out keep the built-in prices
    assert [v.name for v in config.routers["chat"].variants] == ["control", "candidate"]
    assert config.playground.enabled and config.playground.recent_traces == 50
    # Keys with entitlements come as a YAML file, not the one-key-per-line file.
    assert config.api_keys.file == "/etc/splitserve-secrets/api-keys"
    assert config.coordinator.api_keys_file is None


def test_the_playground_is_off_unless_the_values_turn_it_on():
    # On by default for `splitserve up`, off in a cluster: the chart says so explicitly.
    config = parse_config(yaml.safe_load(render("default").config_yaml()))
    assert config.playground.enabled is False


def test_several_coordinators_share_the_workers_through_the_headless_registry():
    rendered = render("coordinators")
    config = parse_config(yaml.safe_load(rendered.config_yaml()))
    assert rendered.get("Deployment", "rel-splitserve-coordinator")["spec"]["replicas"] == 3
    assert config.coordinator.registry_resolve_interval_s == 3
    assert config.coordinator.registries == (f"{REGISTRY_HOST}:50151",)
    registry = rendered.get("Service", "rel-splitserve-coordinator-registry")
    assert registry["spec"]["selector"] == _container_selector(rendered)
    pdb = rendered.get("PodDisruptionBudget", "rel-splitserve-coordinator")
    assert pdb["spec"]["maxUnavailable"] == 1  # a rollout keeps the others serving


def _container_selector(rendered) -> dict:
    deployment = rendered.get("Deployment", "rel-splitserve-coordinator")
    return deployment["spec"]["selector"]["matchLabels"]
