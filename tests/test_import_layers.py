"""clusterwire's modules import one another only downwards: no import cycles.

An AST walk over core/ (``clusterwire``), transports/ and resolvers/ builds the graph of
which module imports which, counting module-level imports, imports inside functions and
imports under ``if TYPE_CHECKING:`` (a type that must come from above is a dependency
too). The graph must have no cycle, and an import inside a function is allowed only where
``LAZY_IMPORTS`` lists it with its reason: a lazy import is how a cycle hides. The lazy
imports left in modules other changes own are listed apart (``NOT_YET_MOVED``), and must be
unlisted once gone. Above the modules, the layers: the core
imports no transport and no resolver (plugins register through entry points), a transport
no other transport (only the shared gRPC code, ``_grpc_common``), a resolver no transport.

Run this file as a script to print the graph's cycles and unlisted lazy imports.
"""

from __future__ import annotations

import ast
import functools
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Where each package's modules live (pyproject's package-dir).
PACKAGE_DIRS = {
    "clusterwire": ROOT / "core",
    "clusterwire.transports": ROOT / "transports",
    "clusterwire.resolvers": ROOT / "resolvers",
}

#: Imports inside functions, by (importer, target module or "*": every clusterwire module
#: the importer imports in functions), with the reason the import must wait.
LAZY_IMPORTS: dict[tuple[str, str], str] = {
    # The command line imports what a subcommand needs when it runs: `--help`, `top` or a
    # data-service command do not load the server stack, nor `serve` the data service.
    ("clusterwire.cli", "*"): "one subcommand's modules, when it runs",
    ("clusterwire.top", "clusterwire.data.addresses"): "the data service, only for its servers",
    ("clusterwire.top", "clusterwire.data.modes"): "the data service, only for its servers",
    ("clusterwire.top", "clusterwire.data.rpc"): "the data service, only for its servers",
    ("clusterwire.server_kind", "clusterwire.data.rpc"): "the data service, only to ask one",
    # The zygote is forked before a task's modules load (what it loads, every task it forks
    # shares, copy-on-write); `serve` loads in the forked task.
    ("clusterwire.zygote", "clusterwire.cli"): "loaded in the forked task, not the zygote",
    # A transport's entry-point module is imported by the plugin manager for its hooks;
    # its transport (grpcio's server, UCX) loads when the protocol is first asked for.
    ("clusterwire.transports.grpc", "clusterwire.transports.grpc.transport"): "plugin hook",
    ("clusterwire.transports.local", "clusterwire.transports.local.transport"): "plugin hook",
    ("clusterwire.transports.verbs", "clusterwire.transports.verbs.transport"): "plugin hook",
    # The C helper may be missing (built without a compiler) and binds to UCX once loaded.
    ("clusterwire.transports.verbs.engine", "clusterwire.transports.verbs._ucp"): "optional C",
    # Element ids' rules (a module as long as the Dataset's) load only when ids are asked for.
    ("clusterwire.data.dataset", "clusterwire.data.provenance"): "only for with_element_ids",
    # Optional extras: pyarrow (Parquet), and the tar reader only for tar shards.
    ("clusterwire.data.file_datasets", "clusterwire.data.parquet"): "pyarrow, an extra",
    ("clusterwire.data.ops.formats", "clusterwire.data.parquet"): "pyarrow, an extra",
    ("clusterwire.data.file_datasets", "clusterwire.data.tar_shards"): "only for tar shards",
    ("clusterwire.data.ops.formats", "clusterwire.data.tar_shards"): "only for tar shards",
    # Test helpers: certificates need `cryptography`, a test extra.
    ("clusterwire.testing.suite", "clusterwire.testing.certs"): "cryptography, a test extra",
}

#: Left as found in modules other changes own (core/data, core/testing): each should move
#: to the top, then leave this table.
NOT_YET_MOVED: dict[tuple[str, str], str] = {
}


@dataclass(frozen=True)
class Import:
    """One import statement's clusterwire target, where it is and how it runs."""

    importer: str
    target: str
    line: int
    lazy: bool  # inside a function


def find_modules(package_dirs: dict[str, Path]) -> dict[str, Path]:
    """Every clusterwire module, by dotted name (a package by its ``__init__.py``), and
    the C extension modules, by their source (``_ucp.c``: ``_ucp``), which import none."""
    modules = {}
    for package, directory in package_dirs.items():
        for path in sorted([*directory.rglob("*.py"), *directory.rglob("*.c")]):
            parts = list(path.relative_to(directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _module_of(name: str, modules: dict[str, Path]) -> str | None:
    """The clusterwire module ``name`` is or is in (``pkg.mod.attr`` -> ``pkg.mod``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, modules: dict[str, Path]) -> list[Import]:
    """The clusterwire modules ``module`` imports (``from pkg import name`` names the
    submodule ``pkg.name`` if there is one, else ``pkg``)."""
    path = modules[module]
    if path.suffix == ".c":
        return []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def add(name: str, node: ast.stmt, lazy: bool) -> None:
        target = _module_of(name, modules)
        if target is not None and target != module:
            found.append(Import(module, target, node.lineno, lazy))

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name, child, lazy)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(base + ([child.module] if child.module else []))
                else:
                    base = child.module or ""
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    add(sub if sub in modules else base, child, lazy)
            else:
                visit(child, lazy or isinstance(
                    child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), False)
    return found


def import_graph() -> tuple[dict[str, set[str]], list[Import]]:
    """The graph (module -> the modules it imports) and every import in it."""
    graph, every = _walk(tuple(PACKAGE_DIRS.items()))
    return {module: set(targets) for module, targets in graph.items()}, every


@functools.cache
def _walk(package_dirs: tuple[tuple[str, Path], ...]
          ) -> tuple[dict[str, set[str]], list[Import]]:
    """``import_graph`` of these package directories (the tests walk the tree once)."""
    modules = find_modules(dict(package_dirs))
    every = [imp for module in modules for imp in imports_of(module, modules)]
    graph: dict[str, set[str]] = {module: set() for module in modules}
    for imp in every:
        graph[imp.importer].add(imp.target)
    return graph, every


def tangles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module: sets of modules that
    all reach one another, so each lies on a cycle (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)
    return components


def _cycle_in(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth first)."""
    start = min(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph[node] & component):
                if successor == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if successor not in came_from:
                    came_from[successor] = node
                    following.append(successor)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def _describe(cycle: list[str], every: list[Import]) -> str:
    """``a -> b (line 12 lazy) -> ...``: each step with the lines that import it."""
    steps = [cycle[0]]
    for importer, target in itertools.pairwise(cycle):
        where = [imp for imp in every if imp.importer == importer and imp.target == target]
        lines = ", ".join(f"{imp.line}{' lazy' if imp.lazy else ''}" for imp in where)
        steps.append(f"-> {target} (line {lines})")
    return " ".join(steps)


def unlisted_lazy(every: list[Import]) -> list[Import]:
    """Imports inside functions that no table lists."""
    return [imp for imp in every if imp.lazy
            and (imp.importer, imp.target) not in LAZY_IMPORTS
            and (imp.importer, "*") not in LAZY_IMPORTS
            and (imp.importer, imp.target) not in NOT_YET_MOVED]


def test_no_import_cycles():
    graph, every = import_graph()
    found = tangles(graph)
    assert not found, "import cycles (one path through each set of modules that import one " \
        "another):\n" + "\n".join(_describe(_cycle_in(tangle, graph), every) for tangle in found)


def test_lazy_imports_are_listed():
    _, every = import_graph()
    unlisted = unlisted_lazy(every)
    assert not unlisted, (
        "imports inside functions that LAZY_IMPORTS does not list (import at the top, "
        "or list it with the reason it must wait):\n"
        + "\n".join(f"{imp.importer}:{imp.line} imports {imp.target}" for imp in unlisted))


def test_listed_lazy_imports_exist():
    _, every = import_graph()
    lazy = {(imp.importer, imp.target) for imp in every if imp.lazy}
    importers = {importer for importer, _ in lazy}
    stale = [key for key in [*LAZY_IMPORTS, *NOT_YET_MOVED]
             if key not in lazy and not (key[1] == "*" and key[0] in importers)]
    assert not stale, f"these imports are no longer inside functions: unlist them: {stale}"


def _layer(module: str) -> str:
    """"transport:NAME", "resolvers" or "core" (everything else, the data service too)."""
    parts = module.split(".")
    if parts[1:2] == ["transports"] and len(parts) > 2:
        return f"transport:{parts[2]}"
    return {"transports": "transports", "resolvers": "resolvers"}.get(
        parts[1] if len(parts) > 1 else "", "core")


def _crosses(importer: str, target: str) -> bool:
    """Whether a module of layer ``importer`` may not import one of layer ``target``."""
    if importer == "core":
        return target != "core"  # the core finds plugins by entry point, never by name
    if importer == "resolvers":
        return target.startswith("transport")
    return (importer.startswith("transport:") and target.startswith("transport:")
            and target not in (importer, "transport:_grpc_common"))


def test_layers_import_only_downwards():
    _, every = import_graph()
    upward = [imp for imp in every if _crosses(_layer(imp.importer), _layer(imp.target))]
    assert not upward, "imports across layers:\n" + "\n".join(
        f"{imp.importer}:{imp.line} imports {imp.target}" for imp in upward)


def test_the_walk_sees_every_kind_of_import(tmp_path, monkeypatch):
    """The walk finds a cycle made of a relative import, a lazy one and one under
    TYPE_CHECKING, and names their lines."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def f():\n    from pkg.c import thing\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE_DIRS", {"pkg": package})
    graph, every = import_graph()
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"},
                     "pkg.c": {"pkg.a"}}
    (tangle,) = tangles(graph)
    cycle = _cycle_in(tangle, graph)
    assert cycle == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    assert _describe(cycle, every) == (
        "pkg.a -> pkg.b (line 1) -> pkg.c (line 2 lazy) -> pkg.a (line 3)")


if __name__ == "__main__":
    graph, every = import_graph()
    for tangle in tangles(graph):
        print("cycle:", _describe(_cycle_in(tangle, graph), every))
        print("  its modules:", ", ".join(sorted(tangle)))
    for imp in unlisted_lazy(every):
        print(f"unlisted lazy import: {imp.importer}:{imp.line} imports {imp.target}")
