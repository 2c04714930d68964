"""What the rendered objects promise: hardened pods, real probes, least-privilege RBAC,
keys only from Secrets, the dashboard for Grafana's sidecar."""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import tomllib

import pytest
import yaml

from services.worker.server import DRAIN_TAIL_S
from tests.chart.conftest import CHART, ROOT, VALUE_SETS, helm_template, render
from tools.commands import planner_cmd


def pod_specs(rendered) -> list[tuple[str, dict]]:
    specs = [
        (d["metadata"]["name"], d["spec"]["template"]["spec"])
        for d in rendered.of_kind("Deployment")
    ]
    specs += [(d["metadata"]["name"], d["spec"]) for d in rendered.of_kind("Pod")]
    specs += [
        (d["metadata"]["name"], d["spec"]["jobTemplate"]["spec"]["template"]["spec"])
        for d in rendered.of_kind("CronJob")
    ]
    return specs


def workers(rendered) -> list[dict]:
    return [
        d for d in rendered.of_kind("Deployment")
        if d["metadata"]["labels"]["app.kubernetes.io/component"] in ("prefill", "decode")
    ]  # fmt: skip


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_pod_runs_non_root_on_a_read_only_root_with_a_writable_tmp(value_set):
    for name, spec in pod_specs(render(value_set)):
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        emptydirs = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and not sc["allowPrivilegeEscalation"]
            assert sc["capabilities"]["drop"] == ["ALL"], name
            if c["name"] != "chat":  # the helm test pod writes nothing
                tmp = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
                assert tmp and tmp[0]["name"] in emptydirs, name


def test_probes_hit_real_endpoints_and_pods_drain_before_they_stop():
    rendered = render("default")
    coordinator = rendered.get("Deployment", "rel-splitserve-coordinator")["spec"]["template"]
    c = coordinator["spec"]["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    for d in [rendered.get("Deployment", "rel-splitserve-coordinator"), *workers(rendered)]:
        spec = d["spec"]["template"]["spec"]
        assert spec["terminationGracePeriodSeconds"] >= 60
        assert spec["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"] > 0
    config = yaml.safe_load(rendered.config_yaml())
    for d in workers(rendered):
        spec = d["spec"]["template"]["spec"]
        c = spec["containers"][0]
        port = c["ports"][0]["containerPort"]
        # grpc.health.v1: SERVING only once loaded and registered, NOT_SERVING while draining.
        assert c["readinessProbe"]["grpc"]["port"] == port
        assert c["startupProbe"]["grpc"]["port"] == port
        assert c["livenessProbe"]["tcpSocket"]["port"] == "grpc"  # a drain is no reason to kill
        assert d["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        # The pod outlives its preStop pause, the worker's own drain and what follows it:
        # the hand-over of its unfinished streams and the server's stop (a tail each).
        pause = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        after_grace = 2 * DRAIN_TAIL_S
        assert spec["terminationGracePeriodSeconds"] > (
            pause + config["worker_drain_grace_s"] + after_grace
        )
    for d in workers(render("everything")):
        c = d["spec"]["template"]["spec"]["containers"][0]
        assert c["readinessProbe"]["tcpSocket"]["port"] == "grpc"  # probes.readiness: tcp


def test_worker_pods_serve_their_model_and_role_on_their_pod_ip():
    rendered = render("two-models")
    seen = set()
    for d in workers(rendered):
        role = d["metadata"]["labels"]["app.kubernetes.io/component"]
        model = d["metadata"]["annotations"]["splitserve.io/model-id"]
        c = d["spec"]["template"]["spec"]["containers"][0]
        port = str(c["ports"][0]["containerPort"])
        assert c["command"] == ["splitserve"]
        assert c["args"] == [
            "serve", role, "--config", "/etc/splitserve/config.yaml", "--model-id", model,
            "--index", "0", "--host", "$(POD_IP)", "--port", port,
        ]  # fmt: skip
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        seen.add((model, role))
        # A headless Service per pool.
        svc = rendered.get("Service", d["metadata"]["name"])
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"] == d["spec"]["selector"]["matchLabels"]
        assert rendered.get("PodDisruptionBudget", d["metadata"]["name"])
    assert len(seen) == 4


def test_gpu_counts_node_selection_and_tolerations_per_pool():
    rendered = render("two-models")

    def pod(name: str) -> dict:
        return rendered.get("Deployment", f"rel-splitserve-{name}")["spec"]["template"]["spec"]

    gpus = {
        name: pod(name)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        for name in ("smollm2-135m-instruct-prefill", "llama-3-1-8b-instruct-prefill",
                     "llama-3-1-8b-instruct-decode")
    }  # fmt: skip
    assert gpus == {
        "smollm2-135m-instruct-prefill": 1,
        "llama-3-1-8b-instruct-prefill": 2,
        "llama-3-1-8b-instruct-decode": 1,
    }
    big_prefill = pod("llama-3-1-8b-instruct-prefill")
    assert big_prefill["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert big_prefill["tolerations"][0]["key"] == "nvidia.com/gpu"
    big_decode = pod("llama-3-1-8b-instruct-decode")
    assert big_decode["containers"][0]["resources"]["limits"]["memory"] == "48Gi"
    assert big_decode["containers"][0]["resources"]["requests"]["cpu"] == "4"
    assert "podAntiAffinity" in big_decode["affinity"]
    volumes = {v["name"]: v for v in big_decode["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "models"
    for d in workers(render("everything")):  # gpus: 0 -> CPU nodes
        limits = d["spec"]["template"]["spec"]["containers"][0]["resources"].get("limits", {})
        assert "nvidia.com/gpu" not in limits


def test_planner_role_grants_only_get_and_patch_on_its_pools_scale():
    rendered = render("planner")
    pools = sorted(d["metadata"]["name"] for d in workers(rendered))
    (role,) = rendered.of_kind("Role")
    (rule,) = role["rules"]
    assert sorted(rule.pop("resourceNames")) == pools
    assert rule == {"apiGroups": ["apps"], "resources": ["deployments/scale"],
                    "verbs": ["get", "patch"]}  # fmt: skip
    (binding,) = rendered.of_kind("RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    (subject,) = binding["subjects"]
    assert subject == {"kind": "ServiceAccount", "name": "rel-splitserve-planner",
                       "namespace": "serving"}  # fmt: skip
    planners = [d for d in rendered.of_kind("Deployment") if "planner" in d["metadata"]["name"]]
    assert len(planners) == 2
    for d in rendered.of_kind("Deployment"):
        spec = d["spec"]["template"]["spec"]
        is_planner = d in planners
        assert (spec["serviceAccountName"] == "rel-splitserve-planner") == is_planner
        assert spec["automountServiceAccountToken"] is is_planner


def test_planner_pods_run_a_command_line_the_planner_accepts():
    rendered = render("planner")
    parser = argparse.ArgumentParser(prog="splitserve")
    planner_cmd.add_commands(parser.add_subparsers(dest="command"))
    deployments = {d["metadata"]["name"] for d in workers(rendered)}
    by_model = {}
    for d in rendered.of_kind("Deployment"):
        if "planner" not in d["metadata"]["name"]:
            continue
        c = d["spec"]["template"]["spec"]["containers"][0]
        args = parser.parse_args(c["args"])
        assert {args.deployment_prefill, args.deployment_decode} <= deployments
        assert args.coordinator == "http://rel-splitserve-coordinator.serving.svc:80"
        assert args.namespace == "serving" and args.dry_run and args.interval == 10
        assert (args.ttft_p99_ms, args.itl_p99_ms) == (800, 60)
        by_model[args.model] = (
            args.min_prefill,
            args.max_prefill,
            args.min_decode,
            args.max_decode,
        )
    assert by_model == {"SmolLM2-135M-Instruct": (1, 8, 1, 16), "qwen2.5-0.5b": (2, 4, 2, 10)}


def test_api_keys_come_from_a_secret_mounted_where_the_config_points():
    for value_set, secret, key in (
        ("default", "rel-splitserve-api-keys", "api-keys"),
        ("existing-secret", "llm-gateway-keys", "keys.txt"),
    ):
        rendered = render(value_set)
        assert "api_keys_file: /etc/splitserve-secrets/api-keys" in rendered.config_yaml()
        for name, spec in pod_specs(rendered):
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            if "coordinator" in name or name.endswith("test-chat"):
                source = volumes["api-keys"]["secret"]
                assert source["secretName"] == secret
                assert source["items"] == [{"key": key, "path": "api-keys"}]
                mount = next(m for m in spec["containers"][0]["volumeMounts"]
                             if m["name"] == "api-keys")  # fmt: skip
                assert mount["mountPath"] == "/etc/splitserve-secrets" and mount["readOnly"]
            else:
                assert "api-keys" not in volumes, name  # workers never see the keys
    generated = render("default").get("Secret", "rel-splitserve-api-keys")
    assert generated["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert not render("existing-secret").of_kind("Secret")
    assert "api_keys_file" not in render("everything").config_yaml()


def test_service_monitor_and_network_policies_select_the_right_pods():
    rendered = render("everything")
    (monitor,) = rendered.of_kind("ServiceMonitor")
    api = rendered.get("Service", "rel-splitserve-coordinator")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= api["metadata"]["labels"].items()
    registry = rendered.get("Service", "rel-splitserve-coordinator-registry")
    assert not selector.items() <= registry["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == "http"
    policies = {p["metadata"]["name"]: p for p in rendered.of_kind("NetworkPolicy")}
    http, registry_rule = policies["rel-splitserve-coordinator"]["spec"]["ingress"]
    assert http["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert {"namespaceSelector"} <= http["from"][1].keys()
    components = registry_rule["from"][0]["podSelector"]["matchExpressions"][2]["values"]
    assert components == ["prefill", "decode"]
    assert "ingress" not in policies["rel-splitserve-planner"]["spec"]


def test_dashboard_ships_for_the_grafana_sidecar_only_when_the_chart_has_one(tmp_path):
    chart = tmp_path / "splitserve"
    shutil.copytree(CHART, chart, ignore=shutil.ignore_patterns("dashboards"))
    assert not [d for d in render("default", chart=chart).of_kind("ConfigMap")
                if d["metadata"]["name"].endswith("-dashboard")]  # fmt: skip
    (chart / "dashboards").mkdir()
    board = {"title": "splitserve", "panels": [{"type": "timeseries", "title": "TTFT p99"}]}
    (chart / "dashboards" / "splitserve.json").write_text(json.dumps(board))
    done = helm_template(chart=chart)
    assert done.returncode == 0, done.stderr
    (cm,) = [d for d in yaml.safe_load_all(done.stdout)
             if d and d["metadata"]["name"] == "rel-splitserve-dashboard"]  # fmt: skip
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["splitserve.json"]) == board


def test_default_image_is_what_make_image_builds():
    # make image tags the archive splitserve:<project version> (image/build.sh); the chart's
    # default is repository splitserve with the tag defaulting to appVersion.
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for name, spec in pod_specs(render()):
        assert {c["image"] for c in spec["containers"]} == {f"splitserve:{version}"}, name


def test_image_repository_points_at_a_registry():
    pushed = render("default", "--set", "image.repository=registry.example:5000/ml/splitserve")
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    for name, spec in pod_specs(pushed):
        images = {c["image"] for c in spec["containers"]}
        assert images == {f"registry.example:5000/ml/splitserve:{version}"}, name


@pytest.mark.parametrize(
    ("value_set", "secret", "key"),
    [
        ("default", "rel-splitserve-internal-token", "token"),
        ("existing-secret", "splitserve-internal", "token.txt"),
    ],
)
def test_the_internal_token_is_mounted_into_every_coordinator_and_worker(value_set, secret, key):
    rendered = render(value_set)
    config = yaml.safe_load(rendered.config_yaml())
    assert config["internal_auth"] == {"token_file": "/etc/splitserve-internal/token"}
    services = [(n, s) for n, s in pod_specs(rendered) if not n.endswith(("planner", "test-chat"))]
    assert len(services) == 3  # the coordinator and the two pools
    for _, spec in services:
        volumes = {v["name"]: v for v in spec["volumes"]}
        source = volumes["internal-token"]["secret"]
        assert source["secretName"] == secret and source["items"] == [{"key": key, "path": "token"}]
        (mount,) = [
            m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "internal-token"
        ]
        assert mount == {"name": "internal-token", "mountPath": "/etc/splitserve-internal",
                         "readOnly": True}  # fmt: skip
    if value_set == "default":  # generated: random, 64 characters
        generated = rendered.get("Secret", secret)["data"][key]
        assert len(base64.b64decode(generated)) == 64


def test_without_internal_auth_no_token_is_mounted_or_configured():
    rendered = render("everything")
    assert "internal_auth" not in yaml.safe_load(rendered.config_yaml())
    for name, spec in pod_specs(rendered):
        assert "internal-token" not in {v["name"] for v in spec.get("volumes", [])}, name


def test_network_policies_are_on_by_default_and_admit_only_the_releases_services():
    policies = {p["metadata"]["name"]: p for p in render("default").of_kind("NetworkPolicy")}
    assert set(policies) == {"rel-splitserve-coordinator", "rel-splitserve-workers"}
    workers_policy = policies["rel-splitserve-workers"]["spec"]
    assert workers_policy["policyTypes"] == ["Ingress"]
    (rule,) = workers_policy["ingress"]
    (peer,) = rule["from"]
    expressions = {e["key"]: e["values"] for e in peer["podSelector"]["matchExpressions"]}
    assert expressions == {
        "app.kubernetes.io/instance": ["rel"],
        "app.kubernetes.io/name": ["splitserve"],
        "app.kubernetes.io/component": ["coordinator", "prefill", "decode"],
    }
    assert "namespaceSelector" not in peer  # this namespace only
    _, registry = policies["rel-splitserve-coordinator"]["spec"]["ingress"]
    components = registry["from"][0]["podSelector"]["matchExpressions"][2]["values"]
    assert components == ["prefill", "decode"]
