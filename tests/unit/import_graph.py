"""The project's static import graph, read with `ast` (nothing is imported or executed).

Every `import`/`from … import` in `services/`, `shared/` and `kernels/` counts, wherever it
sits: module level, inside a function (a lazy import still runs in the process that calls it)
or under `if TYPE_CHECKING:` (a layering rule that type hints may break is no rule), and so
does `importlib.import_module("literal")`. Relative imports are resolved against the
importing module's package. Importing `a.b.c` also imports the packages `a` and `a.b` (their
`__init__`), so every module has an edge to its parent package.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("tools", "services", "engine", "shared", "kernels")
SKIP_DIRS = ("__pycache__",)


@dataclass(frozen=True)
class Edge:
    """`importer` imports `target` at `path:line` (`target` is a project module, or the
    top-level name of an outside one such as `torch`)."""

    importer: str
    target: str
    path: str
    line: int

    def where(self) -> str:
        return f"{self.path}:{self.line}" if self.line else f"{self.path} (parent package)"

    def __str__(self) -> str:
        return f"{self.importer} -> {self.target} ({self.where()})"


@dataclass
class ImportGraph:
    modules: dict[str, Path]  # module name -> file
    edges: dict[str, list[Edge]] = field(default_factory=dict)  # importer -> its imports

    def imports_of(self, module: str) -> list[Edge]:
        return self.edges.get(module, [])

    def all_edges(self) -> Iterator[Edge]:
        for edges in self.edges.values():
            yield from edges

    def path_to(self, start: str, wanted) -> list[Edge] | None:
        """The shortest chain of imports from `start` to a target for which `wanted(target)`
        holds, or None when nothing reachable from `start` qualifies."""
        parent: dict[str, Edge | None] = {start: None}
        queue = deque([start])
        while queue:
            module = queue.popleft()
            for edge in self.imports_of(module):
                if edge.target in parent:
                    continue
                parent[edge.target] = edge
                if wanted(edge.target):
                    chain = [edge]
                    while (prev := parent[chain[-1].importer]) is not None:
                        chain.append(prev)
                    return chain[::-1]
                if edge.target in self.modules:
                    queue.append(edge.target)
        return None


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_files(root: Path = ROOT) -> Iterator[Path]:
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if not any(part in SKIP_DIRS for part in path.parts):
                yield path


def build(root: Path = ROOT) -> ImportGraph:
    modules = {module_name(p, root): p for p in project_files(root)}
    graph = ImportGraph(modules)
    for name, path in modules.items():
        rel = str(path.relative_to(root))
        found = dict.fromkeys(_imports(name, path, modules))  # one edge per (target, line)
        edges = [Edge(name, t, rel, line) for t, line in found]
        if "." in name:  # the parent package's __init__ runs first
            edges.append(Edge(name, name.rsplit(".", 1)[0], rel, 0))
        graph.edges[name] = edges
    return graph


def _imports(name: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, int]]:
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield _resolve(alias.name, modules), node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(name, is_package, node.module, node.level)
            for alias in node.names:
                # `from pkg import mod` imports the module pkg.mod; `from mod import name`
                # imports mod (the name is an attribute of it).
                candidate = f"{base}.{alias.name}"
                target = candidate if candidate in modules else _resolve(base, modules)
                yield target, node.lineno
        elif _is_import_module_call(node):
            yield _resolve(node.args[0].value, modules), node.lineno


def _is_import_module_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call) or len(node.args) != 1:
        return False
    arg, func = node.args[0], node.func
    named = (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id in ("import_module", "__import__")
    )
    return named and isinstance(arg, ast.Constant) and isinstance(arg.value, str)


def _absolute(importer: str, is_package: bool, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    if level - 1 > len(package) - 1:
        raise ValueError(f"{importer}: relative import beyond the top-level package")
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _resolve(dotted: str, modules: dict[str, Path]) -> str:
    """The project module `dotted` names, or the top-level name of an outside package."""
    if dotted in modules:
        return dotted
    top = dotted.split(".")[0]
    if top in PACKAGES:
        # `import shared.x.missing` names no file: point at the nearest existing package so
        # the edge is not lost (the import itself would fail at run time).
        parts = dotted.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        return ".".join(parts) or top
    return top


def within(module: str, packages: Iterable[str]) -> bool:
    """Whether `module` is one of `packages` or inside one of them."""
    return any(module == p or module.startswith(p + ".") for p in packages)


def component(module: str) -> str:
    """The unit the cycle rule is about: a top-level package's subpackage (or module)."""
    return ".".join(module.split(".")[:2])


def cycles(graph: ImportGraph, unit: Callable[[str], str] = component) -> list[list[str]]:
    """Strongly connected sets of units (`component` unless told) with more than one member
    (Tarjan)."""
    succ: dict[str, set[str]] = {}
    for edge in graph.all_edges():
        if edge.target not in graph.modules:
            continue
        a, b = unit(edge.importer), unit(edge.target)
        succ.setdefault(a, set())
        succ.setdefault(b, set())
        if a != b:
            succ[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return found
