"""Rendering the chart with the helm binary from the project's dev dependencies."""

from __future__ import annotations

import functools
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.chart.helm_binary import helm_path

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "splitserve"
VALUES = Path(__file__).parent / "values"
RELEASE, NAMESPACE = "rel", "serving"
# The values sets every structural test runs over: the defaults and the files in values/.
VALUE_SETS = (
    "default",
    "two-models",
    "planner",
    "existing-secret",
    "everything",
    "policy",
    "coordinators",
    "tls-secret",
    "tls-cert-manager",
    "tls-cert-manager-issuer",
    "draft-training",
)


@dataclass(frozen=True)
class Rendered:
    text: str
    docs: tuple[dict, ...]

    def of_kind(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        found = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: found {len(found)}"
        return found[0]

    def config_yaml(self) -> str:
        return self.get("ConfigMap", "rel-splitserve-config")["data"]["config.yaml"]


class RenderError(AssertionError):
    pass


def helm_template(*args: str, chart: Path = CHART) -> subprocess.CompletedProcess:
    return subprocess.run(
        [helm_path(), "template", RELEASE, str(chart), "--namespace", NAMESPACE, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@functools.cache
def render(value_set: str = "default", *extra: str, chart: Path = CHART) -> Rendered:
    """The chart rendered with one values set (a file name under values/, without .yaml)."""
    args = [] if value_set == "default" else ["-f", str(VALUES / f"{value_set}.yaml")]
    done = helm_template(*args, *extra, chart=chart)
    if done.returncode != 0:
        raise RenderError(f"helm template ({value_set}) failed:\n{done.stderr}")
    docs = tuple(d for d in yaml.safe_load_all(done.stdout) if d)
    return Rendered(done.stdout, docs)


@pytest.fixture(scope="session")
def helm() -> str:
    return helm_path()
