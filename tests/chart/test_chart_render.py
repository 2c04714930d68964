"""The chart lints, renders objects the Kubernetes API accepts, and refuses bad values."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.chart.conftest import CHART, VALUE_SETS, VALUES, helm_template, render

# The chart's kubeVersion floor and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.30.0", "1.37.0")
# Custom resources have no schema in kubernetes-validate; their shape is tested elsewhere.
CUSTOM_KINDS = {"ServiceMonitor", "Certificate", "Issuer"}


def test_helm_lint_passes_for_every_values_set(helm):
    for value_set in VALUE_SETS:
        args = [] if value_set == "default" else ["-f", str(VALUES / f"{value_set}.yaml")]
        done = subprocess.run(
            [helm, "lint", "--strict", str(CHART), *args], capture_output=True, text=True
        )
        assert done.returncode == 0, f"{value_set}:\n{done.stdout}{done.stderr}"
        assert "0 chart(s) failed" in done.stdout


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_rendered_objects_pass_strict_kubernetes_validation(value_set):
    rendered = render(value_set)
    kubernetes_validate = Path(sys.executable).with_name("kubernetes-validate")
    for version in KUBE_VERSIONS:
        done = subprocess.run(
            [str(kubernetes_validate), "--strict", "-k", version, "-"],
            input=rendered.text,
            capture_output=True,
            text=True,
            timeout=60,
        )
        report = done.stdout + done.stderr
        assert done.returncode == 0, f"{value_set} on {version}:\n{report}"
        passed = report.count("passed for resource")
        checked = [d for d in rendered.docs if d["kind"] not in CUSTOM_KINDS]
        assert passed == len(checked), f"{value_set} on {version}:\n{report}"


def test_every_values_set_renders_the_expected_objects():
    kinds = {s: {d["kind"] for d in render(s).docs} for s in VALUE_SETS}
    base = {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "ServiceAccount", "Pod"}
    assert base <= kinds["default"] and "Secret" in kinds["default"]
    assert "Secret" not in kinds["existing-secret"] and "Secret" not in kinds["everything"]
    assert {"Role", "RoleBinding"} <= kinds["planner"] and "Role" not in kinds["default"]
    assert {
        "Ingress", "HorizontalPodAutoscaler", "NetworkPolicy", "ServiceMonitor"
    } <= kinds["everything"]  # fmt: skip
    assert "CronJob" in kinds["draft-training"]
    assert not any("CronJob" in k for s, k in kinds.items() if s != "draft-training")


# Each invalid values file and what the error must name.
INVALID = {
    "ratio-not-a-b": "/pools/SmolLM2-135M-Instruct/ratio",
    "ratio-zero": "/pools/SmolLM2-135M-Instruct/ratio",
    "total-zero": "/pools/SmolLM2-135M-Instruct/total",
    "replicas-negative": "/pools/m/prefill",
    "coordinator-replicas-zero": "/coordinator/replicas",
    "backend-unknown": "/config/transfer/backend",
    "gpus-fractional": "/workers/gpus': got number, want integer",
    "gpus-override-text": "/pools/SmolLM2-135M-Instruct/overrides/decode/gpus",
    "ratio-and-explicit": "/pools/SmolLM2-135M-Instruct/prefill",
    "pool-for-unknown-model": "pools.SmolLM2-135M-Instruct-typo: no model with that id",
    "default-pool-incomplete": "/defaultPool': properties 'ratio' required",
    "schema-key-typo": "'kv_cache_byte' not allowed",
    "planner-min-zero": "/planner/min/prefill",
    "block-size": "/config/block_size",
    "drain-longer-than-grace": "workers.terminationGracePeriodSeconds (120) must be at least",
    "internal-auth-key": "/internalAuth/secretKey",
    "tls-without-certificates": "internalAuth.tls.enabled: TLS without certificates. Name a "
    "Secret holding ca.crt, tls.crt and tls.key in internalAuth.tls.existingSecret",
    "tls-health-port-clash": "internalAuth.tls.healthPort (50061) must differ from workers.grpc",
    "training-log-without-volume": "draftTraining.log.enabled needs draftTraining.log.volume",
    "adaptation-without-drafts-volume": "draftTraining.adaptation.enabled needs "
    "draftTraining.drafts.volume",
    "adaptation-without-a-head": "no model drafts with a head (set models[].speculative.method",
    "adaptation-batches": "/draftTraining/adaptation/batches",
    "speculative-method": "/models/0/speculative/method",
}


def test_every_invalid_values_file_is_covered():
    assert {p.stem for p in (VALUES / "invalid").glob("*.yaml")} == set(INVALID)


@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_values_fail_naming_the_field(name):
    done = helm_template("-f", str(VALUES / "invalid" / f"{name}.yaml"))
    assert done.returncode != 0, f"{name} rendered:\n{done.stdout[:500]}"
    assert INVALID[name] in done.stderr, done.stderr


def test_install_notes_tell_the_pool_sizes_and_how_to_get_the_key(helm):
    done = subprocess.run(
        [helm, "install", "rel", str(CHART), "--namespace", "serving", "--dry-run=client",
         "-f", str(VALUES / "existing-secret.yaml")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    notes = done.stdout.split("NOTES:", 1)[1]
    assert "SmolLM2-135M-Instruct: 1 prefill + 3 decode" in notes  # defaultPool: 4 at 1:3
    assert "get secret llm-gateway-keys -o jsonpath='{.data.keys\\.txt}'" in notes
    assert "helm test rel -n serving" in notes
