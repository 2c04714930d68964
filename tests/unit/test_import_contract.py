"""The layer rules, checked on the static import graph (tests/unit/import_graph).

Each top-level folder is one layer, and the rules are about folders:

    tools/     benchmarks, tuner, profiler, the CLI      may import everything below
    services/  what runs in a pod or a local process    never tools/
    engine/    model, KV pool and KV tiers, sampling,   shared/ and kernels/, never a service
               speculative decoding, the step loop
    shared/    torch-free contracts every service uses  nothing of ours but shared/, no torch
    kernels/   native and Triton kernels                nothing of ours

Inside services/, the coordinator reaches only shared/ and the router (its process loads no
torch, engine, kernels or worker code), the router only shared/, and the worker's prefill and
decode roles never import each other. No two subpackages import each other, and neither do
two folders of the coordinator. A failure names every offending import with its file and
line, and for an indirect one the whole chain that leads there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit import import_graph
from tests.unit.import_graph import Edge, ImportGraph, within

# What each layer may never import, directly or through anything it imports.
SHARED_FORBIDDEN = ("tools", "services", "engine", "kernels", "torch")
ENGINE_FORBIDDEN = ("tools", "services")
SERVICES_FORBIDDEN = ("tools",)
KERNELS_FORBIDDEN = ("tools", "services", "engine", "shared")
# The coordinator process: no torch, no engine, no kernels, no worker code (nor grammar
# compilers or numpy): it starts in well under a second and stays small.
COORDINATOR_FORBIDDEN = (
    "tools",
    "engine",
    "kernels",
    "services.worker",
    "services.kvtransfer",
    "services.launcher",
    "services.planner",
    "torch",
    "numpy",
    "llguidance",
)
# The router is called in-process by the coordinator and by the tuner's simulator.
ROUTER_FORBIDDEN = (*COORDINATOR_FORBIDDEN, "services.coordinator")
COORDINATOR = "services.coordinator"


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


@pytest.mark.parametrize(
    ("layer", "banned"),
    [
        ("shared", SHARED_FORBIDDEN),
        ("kernels", KERNELS_FORBIDDEN),
        ("engine", ENGINE_FORBIDDEN),
        ("services", SERVICES_FORBIDDEN),
    ],
)
def test_each_layer_reaches_only_the_layers_below_it(graph, layer, banned):
    offenders = _reachable_violations(graph, (layer,), banned)
    assert not offenders, f"{layer}/ must not reach {banned}:\n  " + "\n  ".join(offenders)


def test_nothing_in_shared_imports_torch(graph):
    offenders = _reachable_violations(graph, ("shared",), ("torch",))
    assert not offenders, "shared/ is torch-free:\n  " + "\n  ".join(offenders)


def test_the_coordinator_reaches_only_shared_and_the_router(graph):
    offenders = _reachable_violations(graph, (COORDINATOR,), COORDINATOR_FORBIDDEN)
    assert not offenders, "services.coordinator must stay light:\n  " + "\n  ".join(offenders)


def test_the_router_reaches_only_shared(graph):
    offenders = _reachable_violations(graph, ("services.router",), ROUTER_FORBIDDEN)
    assert not offenders, "services.router is plain code over states:\n  " + "\n  ".join(offenders)


@pytest.mark.parametrize(
    ("role", "other"),
    [
        ("services.worker.prefill", "services.worker.decode"),
        ("services.worker.decode", "services.worker.prefill"),
    ],
)
def test_prefill_and_decode_never_import_each_other(graph, role, other):
    offenders = _reachable_violations(graph, (role,), (other,))
    assert not offenders, f"{role} must not import {other}:\n  " + "\n  ".join(offenders)


def _cycle_messages(graph: ImportGraph, component) -> list[str]:
    messages = []
    for members in import_graph.cycles(graph, component):
        crossing = sorted(
            {
                str(e)
                for e in graph.all_edges()
                if e.target in graph.modules
                and component(e.importer) in members
                and component(e.target) in members
                and component(e.importer) != component(e.target)
            }
        )
        messages.append(f"{' <-> '.join(members)}:\n      " + "\n      ".join(crossing))
    return messages


def test_no_import_cycles_between_subpackages(graph):
    messages = _cycle_messages(graph, import_graph.component)
    assert not messages, "import cycles between subpackages:\n  " + "\n  ".join(messages)


def test_the_coordinator_folders_follow_the_request_path_without_cycles(graph):
    def folder(module: str) -> str:
        # services.coordinator.api.app -> services.coordinator.api; a module at the
        # coordinator's root is a unit of its own.
        return ".".join(module.split(".")[:3])

    inside = import_graph.ImportGraph(
        {m: p for m, p in graph.modules.items() if within(m, (COORDINATOR,))},
        {m: e for m, e in graph.edges.items() if within(m, (COORDINATOR,))},
    )
    messages = _cycle_messages(inside, folder)
    assert not messages, "import cycles between coordinator folders:\n  " + "\n  ".join(messages)


def test_the_graph_sees_the_project(graph):
    # A graph that silently lost its files or edges would pass every rule above.
    assert "services.coordinator.main" in graph.modules
    assert "engine.core.engine" in graph.modules
    assert "tools.cli" in graph.modules
    targets = {e.target for e in graph.imports_of("engine.core.engine")}
    assert {"torch", "engine.core", "engine.core.kv_setup"} <= targets


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
