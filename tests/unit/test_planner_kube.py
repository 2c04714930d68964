"""The planner's Kubernetes calls, against a local stand-in for the API server.

No real API server can run here. `KubeScaleAPIStandIn` implements only the two endpoints the
planner uses (GET and PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale, as the
API server answers them: a Scale object, merge-patch bodies, 404/403 Status errors), on
127.0.0.1 with a port of the OS's choosing. The coordinator's /metrics is served from the
coordinator's own metrics code.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from services.coordinator.api.metrics import APIMetrics
from services.planner.decide import Policy
from services.planner.kube import KubeScaler, ScaleAPIError
from services.planner.loop import Planner, PlannerConfig, http_metrics
from tools.commands import planner_cmd

SCALE_PATH = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale$")
NS = "serving"


class KubeScaleAPIStandIn(ThreadingHTTPServer):
    """Deployments' scale subresource, and a log of every request made to it."""

    daemon_threads = True
    block_on_close = False  # teardown never waits on a client's idle connection

    def __init__(self, replicas: dict[str, int], forbidden: frozenset[str] = frozenset()):
        super().__init__(("127.0.0.1", 0), _ScaleHandler)
        self.replicas = dict(replicas)
        self.forbidden = forbidden  # deployments RBAC would refuse
        self.patch_forbidden: frozenset[str] = frozenset()  # readable, not writable
        self.requests: list[tuple[str, str, str | None, object]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _ScaleHandler(BaseHTTPRequestHandler):
    server: KubeScaleAPIStandIn
    timeout = 5  # seconds a connection may sit idle

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._handle("GET")

    def do_PATCH(self) -> None:  # noqa: N802
        self._handle("PATCH")

    def _handle(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        content_type = self.headers.get("Content-Type")
        self.server.requests.append((method, self.path, content_type, body))
        match = SCALE_PATH.match(self.path.split("?")[0])
        if not match or match[1] != NS:
            return self._status(404, "NotFound", f"no route {self.path}")
        name = match[2]
        if name in self.server.forbidden or (
            method == "PATCH" and name in self.server.patch_forbidden
        ):
            return self._status(403, "Forbidden", f"cannot {method.lower()} {name}/scale")
        if name not in self.server.replicas:
            return self._status(404, "NotFound", f'deployments.apps "{name}" not found')
        if method == "PATCH":
            if content_type != "application/merge-patch+json":
                return self._status(415, "UnsupportedMediaType", str(content_type))
            replicas = body["spec"]["replicas"]
            if not isinstance(replicas, int) or replicas < 0:
                return self._status(422, "Invalid", f"spec.replicas: {replicas!r}")
            self.server.replicas[name] = replicas
        n = self.server.replicas[name]
        self._json(
            200,
            {
                "kind": "Scale",
                "apiVersion": "autoscaling/v1",
                "metadata": {"name": name, "namespace": NS},
                "spec": {"replicas": n},
                "status": {"replicas": n, "selector": f"app={name}"},
            },
        )

    def _status(self, code: int, reason: str, message: str) -> None:
        body = {"kind": "Status", "apiVersion": "v1", "status": "Failure"}
        self._json(code, {**body, "reason": reason, "message": message, "code": code})

    def _json(self, code: int, doc: dict) -> None:
        data = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


class MetricsEndpoint(ThreadingHTTPServer):
    """GET /metrics rendering a real APIMetrics registry the test feeds."""

    daemon_threads = True
    block_on_close = False

    def __init__(self) -> None:
        self.metrics = APIMetrics()
        metrics = self.metrics

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                data = metrics.render()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def _serve(server: ThreadingHTTPServer) -> Iterator:
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def api() -> Iterator[KubeScaleAPIStandIn]:
    yield from _serve(KubeScaleAPIStandIn({"m-prefill": 2, "m-decode": 3}, frozenset({"other"})))


@pytest.fixture
def coordinator() -> Iterator[MetricsEndpoint]:
    yield from _serve(MetricsEndpoint())


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_scaler_reads_and_patches_the_scale_subresource(api):
    scaler = KubeScaler(NS, api.url)
    assert scaler.get_replicas("m-decode") == 3
    scaler.set_replicas("m-decode", 5)
    assert api.replicas["m-decode"] == 5
    method, path, content_type, body = api.requests[-1]
    assert (method, path.split("?")[0]) == (
        "PATCH",
        f"/apis/apps/v1/namespaces/{NS}/deployments/m-decode/scale",
    )
    assert content_type == "application/merge-patch+json"
    assert body == {"spec": {"replicas": 5}}


def test_scaler_errors_name_the_call_and_the_cause(api):
    scaler = KubeScaler(NS, api.url)
    with pytest.raises(ScaleAPIError, match=r"GET scale of deployment serving/other: HTTP 403"):
        scaler.get_replicas("other")
    with pytest.raises(ScaleAPIError, match=r"HTTP 404"):
        scaler.set_replicas("missing", 1)
    down = KubeScaler(NS, closed_port_url(), timeout_s=2)
    with pytest.raises(ScaleAPIError, match=r"GET scale of deployment serving/m-prefill: \w+"):
        down.get_replicas("m-prefill")


def _planner(coordinator, api_url: str, clock, **config) -> Planner:
    policy = Policy(prefill_tokens_per_s=1000, decode_tokens_per_s=100, decode_seqs=8,
                    target_utilization=1.0, min_prefill=1, max_prefill=6, min_decode=2,
                    max_decode=6, ttft_p99_s=None, itl_p99_s=None)  # fmt: skip
    cfg = PlannerConfig("m-prefill", "m-decode", policy, cooldown_s=0, **config)
    return Planner(cfg, http_metrics(coordinator.url, "m", clock=clock), KubeScaler(NS, api_url),
                   clock=clock)  # fmt: skip


def _traffic(coordinator: MetricsEndpoint, prompt: int, completion: int) -> None:
    coordinator.metrics.count_tokens("m", "default", prompt, 0, completion)


def test_planner_scales_the_deployments_from_the_coordinators_metrics(api, coordinator):
    now = [0.0]
    planner = _planner(coordinator, api.url, lambda: now[0])
    assert planner.step().action == "hold"  # one sample: no rate yet
    # 10 s later: 45,000 prompt tokens (4,500/s: 5 prefill replicas of 1,000/s) and 4,500
    # generated tokens (450/s: 5 decode replicas of 100/s).
    now[0] = 10.0
    _traffic(coordinator, 45_000, 4_500)
    result = planner.step()
    assert result.action == "scaled", result.message
    assert api.replicas == {"m-prefill": 5, "m-decode": 5}
    patches = [(p.split("/")[-2], b) for m, p, _, b in api.requests if m == "PATCH"]
    assert patches == [("m-prefill", {"spec": {"replicas": 5}}),
                       ("m-decode", {"spec": {"replicas": 5}})]  # fmt: skip
    # The same load 10 s on: both pools fit, nothing is patched.
    now[0] = 20.0
    _traffic(coordinator, 45_000, 4_500)
    assert planner.step().action == "hold"
    assert len([r for r in api.requests if r[0] == "PATCH"]) == 2


def test_dry_run_logs_the_decision_and_patches_nothing(api, coordinator, caplog):
    now = [0.0]
    planner = _planner(coordinator, api.url, lambda: now[0], dry_run=True)
    planner.step()
    now[0] = 10.0
    _traffic(coordinator, 45_000, 2_500)
    with caplog.at_level(logging.INFO, logger="splitserve.planner"):
        result = planner.step()
    assert result.action == "dry-run"
    assert "dry run, not applied: prefill 2->5" in caplog.text
    assert api.replicas == {"m-prefill": 2, "m-decode": 3}
    assert not [r for r in api.requests if r[0] == "PATCH"]


def test_api_unreachable_keeps_the_counts_and_says_why(coordinator, caplog):
    planner = _planner(coordinator, closed_port_url(), lambda: 0.0)
    with caplog.at_level(logging.WARNING, logger="splitserve.planner"):
        result = planner.step()
    assert result.action == "api-error" and result.decision is None
    assert "Kubernetes API unavailable, keeping current counts" in caplog.text
    assert "GET scale of deployment serving/m-prefill" in caplog.text


def test_metrics_unreachable_holds_without_touching_the_api(api, caplog):
    planner = Planner(
        PlannerConfig("m-prefill", "m-decode"),
        http_metrics(closed_port_url(), "m"),
        KubeScaler(NS, api.url),
    )
    with caplog.at_level(logging.WARNING, logger="splitserve.planner"):
        assert planner.step().action == "no-metrics"
    assert "metrics unavailable, keeping current counts" in caplog.text
    assert api.requests == []


def test_a_refused_patch_keeps_that_pool_and_still_sets_the_other(api, coordinator):
    now = [0.0]
    planner = _planner(coordinator, api.url, lambda: now[0])
    planner.step()
    api.patch_forbidden = frozenset({"m-prefill"})
    now[0] = 10.0
    _traffic(coordinator, 45_000, 4_500)
    result = planner.step()
    assert result.action == "api-error"
    assert "prefill kept at 2: PATCH scale of deployment serving/m-prefill to 5: HTTP 403" in (
        result.message
    )
    assert api.replicas == {"m-prefill": 2, "m-decode": 5}
    assert set(planner.last_change) == {"decode"}


def test_cli_once_raises_a_pool_below_its_minimum(api, coordinator):
    api.replicas["m-decode"] = 1
    parser = _parser()
    args = parser.parse_args(
        ["planner", "--coordinator", coordinator.url, "--namespace", NS,
         "--deployment-prefill", "m-prefill", "--deployment-decode", "m-decode",
         "--kube-api", api.url, "--min-decode", "2", "--once"]
    )  # fmt: skip
    assert args.handler(args) == 0
    assert api.replicas == {"m-prefill": 2, "m-decode": 2}


def test_cli_refuses_bad_bounds(capsys):
    parser = _parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["planner", "--coordinator", "x", "--namespace", NS,
                           "--deployment-prefill", "a", "--deployment-decode", "b",
                           "--min-prefill", "0"])  # fmt: skip
    assert "below 1" in capsys.readouterr().err
    args = parser.parse_args(["planner", "--coordinator", "x", "--namespace", NS,
                              "--deployment-prefill", "a", "--deployment-decode", "b",
                              "--min-decode", "5", "--max-decode", "4"])  # fmt: skip
    assert args.handler(args) == 2
    assert "--min-decode (5) exceeds --max-decode (4)" in capsys.readouterr().err


def _parser():
    import argparse

    parser = argparse.ArgumentParser(prog="splitserve")
    planner_cmd.add_commands(parser.add_subparsers(dest="command"))
    return parser
