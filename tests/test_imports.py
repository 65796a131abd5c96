"""Imports flow one way (issue 17): no import cycle among gridd's modules; the pure core
(gridd/core) imports no trio, httpx, hypercorn, h11 or trio_websocket, and no gridd module
built on it (the wire, config, the IO shell), so it reaches none of them indirectly either.

The module graph is read from the AST of every gridd/**/*.py, so every import counts: one
inside a function, and one under ``if TYPE_CHECKING:``, closes a cycle as surely as one at
the top (a function-local import only defers the circle to the first call).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gridd"
IO_LIBRARIES = frozenset({"trio", "httpx", "hypercorn", "h11", "trio_websocket"})


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


class Import(NamedTuple):
    """One import statement's target module, and the line it is written on."""

    target: str
    line: int


def imports_of(path: Path, known: set[str], root: Path = ROOT) -> list[Import]:
    """Every module one file imports, by full name (``known``: the modules that exist, to
    tell ``from package import module`` from ``from module import name``)."""
    name = module_name(path, root)
    # The package a relative import is resolved against.
    package = name if is_package(path) else name.rpartition(".")[0]
    found: list[Import] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            found.append(Import(source, node.lineno))
            # ``from gridd.core import batch`` imports the module gridd.core.batch.
            found.extend(Import(f"{source}.{alias.name}", node.lineno)
                         for alias in node.names if f"{source}.{alias.name}" in known)
    return found


def build_graph() -> tuple[dict[str, list[Import]], dict[str, Path]]:
    paths = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    known = set(paths)
    graph: dict[str, list[Import]] = {}
    for name, path in paths.items():
        graph[name] = imports_of(path, known)
    return graph, paths


GRAPH, PATHS = build_graph()


def gridd_edges(name: str) -> list[Import]:
    """The gridd modules ``name`` imports (a ``from gridd.x import name`` of a non-module
    name is an import of gridd.x)."""
    return [imp for imp in GRAPH[name] if imp.target in GRAPH and imp.target != name]


def strongly_connected(graph: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work: list[tuple[str, int]] = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            successors = graph[node]
            if i < len(successors):
                work.append((node, i + 1))
                nxt = successors[i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return components


def a_cycle(component: list[str], graph: dict[str, list[str]]) -> list[str]:
    """One concrete cycle through a component, for the failure message."""
    members = set(component)
    start = component[0]
    path, seen = [start], {start}
    while True:
        nxt = next(n for n in graph[path[-1]] if n in members)
        if nxt in seen:
            return [*path[path.index(nxt):], nxt]
        path.append(nxt)
        seen.add(nxt)


def describe(cycle: list[str]) -> str:
    steps = []
    for here, there in zip(cycle, cycle[1:], strict=False):
        line = next(imp.line for imp in gridd_edges(here) if imp.target == there)
        steps.append(f"{PATHS[here].relative_to(ROOT)}:{line} imports {there}")
    return "; ".join(steps)


def test_the_graph_is_read():
    # The reader must see what is there, or the two tests below prove nothing.
    assert "gridd.core.batch" in GRAPH and "gridd.wire" in GRAPH
    assert any(imp.target == "gridd.core.batch" for imp in gridd_edges("gridd.wire"))
    assert any(imp.target == "trio" for imports in GRAPH.values() for imp in imports)


def test_no_import_cycle_among_gridd_modules():
    graph = {name: sorted({imp.target for imp in gridd_edges(name)}) for name in GRAPH}
    cycles = [a_cycle(c, graph) for c in strongly_connected(graph) if len(c) > 1]
    assert not cycles, "import cycles:\n" + "\n".join(describe(c) for c in cycles)


def test_the_core_imports_no_io_library():
    core = [name for name in GRAPH if name == "gridd.core" or name.startswith("gridd.core.")]
    found = [f"{PATHS[name].relative_to(ROOT)}:{imp.line} imports {imp.target}"
             for name in core for imp in GRAPH[name] if imp.target.split(".")[0] in IO_LIBRARIES]
    assert not found, "\n".join(found)


CORE_MAY_IMPORT = frozenset({"gridd.errors"})
"""What the core may import from gridd outside itself: the error base classes, which import
nothing. Everything else (the wire, config, the IO shell) is built on the core, not under it."""


def test_the_core_imports_nothing_built_on_it():
    # A cycle at the level of layers: the core importing gridd.wire while gridd.wire carries
    # the core's readings is a circle even when no two modules import each other. And a core
    # module importing a gridd module that imports trio would be no purer than importing it.
    found = [f"{PATHS[name].relative_to(ROOT)}:{imp.line} imports {imp.target}"
             for name in GRAPH if name == "gridd.core" or name.startswith("gridd.core.")
             for imp in gridd_edges(name)
             if not imp.target.startswith("gridd.core.")
             and imp.target not in {"gridd.core", *CORE_MAY_IMPORT}]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(("source", "expected"), [
    ("import trio\n", ["trio"]),
    ("def f():\n    from gridd.core import batch\n", ["gridd.core", "gridd.core.batch"]),
    ("from . import batch\n", ["gridd.core", "gridd.core.batch"]),
    ("from .. import wire\n", ["gridd", "gridd.wire"]),
    ("from ..errors import GriddError\n", ["gridd.errors"]),
    ("if TYPE_CHECKING:\n    from gridd.config import Config\n", ["gridd.config"]),
])
def test_the_reader_resolves_every_form_of_import(tmp_path, source, expected):
    # Written as if it were gridd/core/example.py.
    fake = tmp_path / "gridd" / "core" / "example.py"
    fake.parent.mkdir(parents=True)
    fake.write_text(source)
    found = [imp.target for imp in imports_of(fake, {"gridd.core.batch", "gridd.wire"}, tmp_path)]
    assert found == expected


def test_a_function_local_import_closing_a_circle_is_found():
    graph = {"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}
    assert [c for c in strongly_connected(graph) if len(c) > 1] == [["a", "b", "c"]]
    assert a_cycle(["a", "b", "c"], graph) == ["a", "b", "c", "a"]


# The layers of docs/layout.md, lowest first. A module may import its own layer or a lower one.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("gridd.core", "gridd.errors")),
    ("wire", ("gridd.wire",)),
    ("transports and shells", (
        "gridd.link", "gridd.http", "gridd.tls", "gridd.certs", "gridd.state", "gridd.config",
        "gridd.config_schema", "gridd.config_rules", "gridd.credentials", "gridd.reload_plan",
        "gridd.clock", "gridd.log", "gridd.notify", "gridd.control", "gridd.metrics_app",
        "gridd.childprocs")),
    ("roles", ("gridd.operator", "gridd.gateway", "gridd.api", "gridd.probes", "gridd.sim",
               "gridd.roles")),
    ("entry points", ("gridd",)),
)


def layer_of(module: str) -> int:
    """The index in LAYERS of the most specific prefix naming ``module``."""
    best, best_length = len(LAYERS) - 1, 0
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    return best


def test_imports_only_point_down_the_layers_of_docs_layout():
    found = [f"{PATHS[name].relative_to(ROOT)}:{imp.line} ({LAYERS[layer_of(name)][0]}) imports "
             f"{imp.target} ({LAYERS[layer_of(imp.target)][0]})"
             for name in GRAPH if name != "gridd"
             for imp in gridd_edges(name)
             if imp.target != "gridd" and layer_of(imp.target) > layer_of(name)]
    assert not found, "\n".join(found)


def test_the_layer_table_places_modules_as_docs_layout_says():
    assert LAYERS[layer_of("gridd.core.store")][0] == "core"
    assert LAYERS[layer_of("gridd.link.poller")][0] == "transports and shells"
    assert LAYERS[layer_of("gridd.config_schema")][0] == "transports and shells"
    assert LAYERS[layer_of("gridd.gateway.front")][0] == "roles"
    assert LAYERS[layer_of("gridd.daemon")][0] == "entry points"


MODULE_LINES_MAX = 600


def test_no_module_under_gridd_exceeds_600_lines():
    long = {f"{path.relative_to(ROOT)}: {n}" for path in PATHS.values()
            if (n := len(path.read_text().splitlines())) > MODULE_LINES_MAX}
    assert not long, sorted(long)
