"""Internal mutual TLS in the chart: certificates from a Secret of yours or from cert-manager
(under your CA issuer or a deployment CA the chart makes), mounted into every coordinator and
worker pod and named in config.yaml; worker probes move to the plaintext health port; off by
default, nothing of it rendered."""

from __future__ import annotations

import pytest
import yaml

from shared.config.schema import parse_config
from tests.chart.conftest import render
from tests.chart.test_chart_objects import pod_specs, workers

TLS_DIR = "/etc/splitserve-tls"
FILES = [{"key": k, "path": k} for k in ("ca.crt", "tls.crt", "tls.key")]


def _services(rendered) -> list[tuple[str, dict]]:
    """The pods that speak internal gRPC: the coordinator and every worker pool."""
    return [(n, s) for n, s in pod_specs(rendered) if not n.endswith(("planner", "test-chat"))]


@pytest.mark.parametrize(
    ("value_set", "secret", "server_name", "token"),
    [
        ("tls-secret", "splitserve-internal-certs", "splitserve.internal", True),
        ("tls-cert-manager", "rel-splitserve-internal-tls", "rel-splitserve-internal", False),
        ("tls-cert-manager-issuer", "rel-splitserve-internal-tls", "rel-splitserve-internal", True),
    ],
)
def test_every_service_pod_mounts_the_certificates_the_config_names(
    value_set, secret, server_name, token
):
    rendered = render(value_set)
    config = parse_config(yaml.safe_load(rendered.config_yaml()))
    tls = config.internal_auth.tls
    assert (tls.ca_file, tls.cert_file, tls.key_file) == (
        f"{TLS_DIR}/ca.crt", f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key",
    )  # fmt: skip
    assert tls.enabled and tls.server_name == server_name and tls.health_port == 50062
    assert (config.internal_auth.token_file is not None) is token  # the token is independent
    services = _services(rendered)
    assert len(services) == 3
    for name, spec in services:
        volumes = {v["name"]: v for v in spec["volumes"]}
        source = volumes["internal-tls"]["secret"]
        assert source["secretName"] == secret and source["items"] == FILES, name
        mounts = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "internal-tls"]
        assert mounts == [{"name": "internal-tls", "mountPath": TLS_DIR, "readOnly": True}], name


def test_worker_probes_ask_the_plaintext_health_port_when_tls_is_on():
    """The kubelet's gRPC probe speaks no TLS: it asks the port serving grpc.health.v1 alone;
    liveness still only connects to the TLS port."""
    for d in workers(render("tls-secret")):
        c = d["spec"]["template"]["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"grpc": 50061, "health": 50062}
        assert c["readinessProbe"]["grpc"]["port"] == c["startupProbe"]["grpc"]["port"] == 50062
        assert c["livenessProbe"]["tcpSocket"]["port"] == "grpc"


def test_cert_manager_issues_the_certificate_under_a_deployment_ca_the_chart_makes():
    rendered = render("tls-cert-manager")
    config = parse_config(yaml.safe_load(rendered.config_yaml()))
    certs = {c["metadata"]["name"]: c["spec"] for c in rendered.of_kind("Certificate")}
    issuers = {i["metadata"]["name"]: i["spec"] for i in rendered.of_kind("Issuer")}
    assert set(certs) == {"rel-splitserve-internal-ca", "rel-splitserve-internal"}
    assert issuers == {
        "rel-splitserve-selfsigned": {"selfSigned": {}},
        "rel-splitserve-internal-ca": {"ca": {"secretName": "rel-splitserve-internal-ca"}},
    }
    ca, leaf = certs["rel-splitserve-internal-ca"], certs["rel-splitserve-internal"]
    assert ca["isCA"] is True and ca["issuerRef"]["name"] == "rel-splitserve-selfsigned"
    assert ca["secretName"] == "rel-splitserve-internal-ca"
    assert leaf["issuerRef"] == {
        "name": "rel-splitserve-internal-ca", "kind": "Issuer", "group": "cert-manager.io"
    }  # fmt: skip
    # One certificate is both ends of every call, and names what clients check for.
    assert {"server auth", "client auth"} <= set(leaf["usages"])
    assert config.internal_auth.tls.server_name in leaf["dnsNames"]
    assert leaf["secretName"] == "rel-splitserve-internal-tls"


def test_cert_manager_with_your_issuer_renders_only_the_pods_certificate():
    rendered = render("tls-cert-manager-issuer")
    assert not rendered.of_kind("Issuer")
    (leaf,) = rendered.of_kind("Certificate")
    assert leaf["spec"]["issuerRef"] == {
        "name": "platform-internal-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"
    }  # fmt: skip


def test_tls_is_off_by_default_and_nothing_of_it_is_rendered():
    rendered = render("default")
    config = parse_config(yaml.safe_load(rendered.config_yaml()))
    assert not config.internal_auth.tls.enabled
    assert "tls" not in yaml.safe_load(rendered.config_yaml())["internal_auth"]
    assert not rendered.of_kind("Certificate") and not rendered.of_kind("Issuer")
    for name, spec in pod_specs(rendered):
        assert "internal-tls" not in {v["name"] for v in spec.get("volumes", [])}, name
