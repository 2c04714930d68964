"""Which package may import which, checked on the static import graph (tests/unit/import_graph).

The rules keep the coordinator light (no torch, model, engine or worker code in its process),
keep the prefill and decode roles independent, and keep `shared/` and `kernels/` below the
services that use them. A failure names every offending import with its file and line, and for
an indirect one the whole chain that leads there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit import import_graph
from tests.unit.import_graph import Edge, ImportGraph, within

# What the coordinator process must never load, directly or through anything it imports.
COORDINATOR_FORBIDDEN = (
    "services.prefill",
    "services.decode",
    "services.worker",
    "services.worker_server",
    "services.inprocess",
    "shared.engine",
    "shared.model",
    "shared.grammar",
    "kernels",
    "torch",
    "llguidance",
)


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return import_graph.build()


def _chain(edges: list[Edge]) -> str:
    return "\n      ".join(str(e) for e in edges)


def _reachable_violations(graph: ImportGraph, sources: tuple[str, ...], banned) -> list[str]:
    """One line (with its import chain) per module under `sources` that reaches a banned one."""
    found = []
    for module in sorted(graph.modules):
        if not within(module, sources):
            continue
        chain = graph.path_to(module, lambda target: within(target, banned))
        if chain is not None:
            found.append(f"{module} reaches {chain[-1].target}:\n      {_chain(chain)}")
    return found


def test_the_coordinator_never_reaches_engine_model_or_worker_code(graph):
    offenders = _reachable_violations(graph, ("services.coordinator",), COORDINATOR_FORBIDDEN)
    assert not offenders, "services.coordinator must stay torch-free:\n  " + "\n  ".join(offenders)


@pytest.mark.parametrize(
    ("role", "other"),
    [("services.prefill", "services.decode"), ("services.decode", "services.prefill")],
)
def test_prefill_and_decode_never_import_each_other(graph, role, other):
    offenders = _reachable_violations(graph, (role,), (other,))
    assert not offenders, f"{role} must not import {other}:\n  " + "\n  ".join(offenders)


def _direct_violations(graph: ImportGraph, sources: tuple[str, ...], banned) -> list[str]:
    return [
        str(e)
        for e in graph.all_edges()
        if within(e.importer, sources) and within(e.target, banned)
    ]


def test_shared_imports_no_service(graph):
    offenders = _direct_violations(graph, ("shared",), ("services",))
    assert not offenders, "shared/ is below services/:\n  " + "\n  ".join(offenders)


def test_kernels_import_neither_shared_nor_services(graph):
    offenders = _direct_violations(graph, ("kernels",), ("shared", "services"))
    assert not offenders, "kernels/ depends on nothing of ours:\n  " + "\n  ".join(offenders)


def test_no_import_cycles_between_subpackages(graph):
    messages = []
    for members in import_graph.cycles(graph):
        crossing = sorted(
            {
                str(e)
                for e in graph.all_edges()
                if e.target in graph.modules
                and import_graph.component(e.importer) in members
                and import_graph.component(e.target) in members
                and import_graph.component(e.importer) != import_graph.component(e.target)
            }
        )
        messages.append(f"{' <-> '.join(members)}:\n      " + "\n      ".join(crossing))
    assert not messages, "import cycles between subpackages:\n  " + "\n  ".join(messages)


def test_the_graph_sees_the_project(graph):
    # A graph that silently lost its files or edges would pass every rule above.
    assert "services.coordinator.app" in graph.modules
    assert "shared.engine.engine" in graph.modules
    targets = {e.target for e in graph.imports_of("shared.engine.engine")}
    assert {"torch", "shared.engine", "shared.kvcache.block_manager"} <= targets


# -- the analysis itself, on a made-up tree -------------------------------------------------


def _tree(root: Path, files: dict[str, str]) -> ImportGraph:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return import_graph.build(root)


def test_relative_lazy_and_from_package_imports_are_resolved(tmp_path):
    g = _tree(
        tmp_path,
        {
            "services/__init__.py": "",
            "services/a/__init__.py": "from . import b\n",
            "services/a/b.py": "from .c import thing\nfrom ..d import e\n",
            "services/a/c.py": "def f():\n    import torch.nn\n    from shared import x\n",
            "services/d/__init__.py": "",
            "services/d/e.py": "import importlib\nimportlib.import_module('kernels.k')\n",
            "shared/__init__.py": "",
            "shared/x.py": "",
            "kernels/__init__.py": "",
            "kernels/k.py": "",
        },
    )
    assert {(e.target, e.line) for e in g.imports_of("services.a")} == {
        ("services.a.b", 1),
        ("services", 0),
    }
    assert {e.target for e in g.imports_of("services.a.b")} >= {"services.a.c", "services.d.e"}
    c = {(e.target, e.line) for e in g.imports_of("services.a.c")}
    assert {("torch", 2), ("shared.x", 3)} <= c
    assert ("kernels.k", 2) in {(e.target, e.line) for e in g.imports_of("services.d.e")}
    chain = g.path_to("services.a", lambda t: t == "torch")
    assert [e.importer for e in chain] == ["services.a", "services.a.b", "services.a.c"]
    assert chain[-1].where() == "services/a/c.py:2"


def test_a_cycle_between_subpackages_is_found(tmp_path):
    g = _tree(
        tmp_path,
        {
            "services/__init__.py": "",
            "services/worker/__init__.py": "",
            "services/worker/server.py": "from services.prefill.service import S\n",
            "services/worker/runtime.py": "",
            "services/prefill/__init__.py": "",
            "services/prefill/service.py": "from services.worker import runtime\n",
            "services/decode/__init__.py": "",
            "services/decode/service.py": "from services.worker import runtime\n",
        },
    )
    assert import_graph.cycles(g) == [["services.prefill", "services.worker"]]
