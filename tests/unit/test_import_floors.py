"""Imports go one way: a module imports only modules on its own floor or below (docs/ARCHITECTURE.md).

Every ``import`` and ``from ... import`` of a ``tokenmill`` module in ``src/`` is read with ``ast`` (imports
inside functions too: a lazy import is still an arrow) and checked against the floors below. A module on no
floor fails the test, so a new one has to be placed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tokenmill

SRC = Path(tokenmill.__file__).resolve().parent
# lowest first; a unit is a top-level module or package of tokenmill
FLOORS: list[set[str]] = [
    {
        "errors",
        "json_schema",
        "constraint_limits",
        "config",
        "sampling_params",
        "request",
        "outputs",
        "generation_defaults",
        "tokenizer",
        "detokenizer",
        "engine_args",
        "reasoning",
        "lora_request",
    },  # fmt: skip
    {"cache"},
    {"core", "stats", "measure"},
    {"model", "structured_outputs"},
    {"worker"},
    {"engine"},
    {"llm", "system_info", "__init__"},
    {"server", "bench"},
    {"serving"},
    {"cli"},
]
FLOOR = {unit: level for level, units in enumerate(FLOORS) for unit in units}


def _unit(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.stem != "__init__" else "__init__"


def _targets(node: ast.AST) -> list[str]:
    """The tokenmill units an import statement reaches (``from tokenmill import errors`` reaches errors)."""
    if isinstance(node, ast.Import):
        return [
            a.name.split(".")[1] if "." in a.name else "__init__"
            for a in node.names
            if a.name.startswith("tokenmill")
        ]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        if node.module == "tokenmill":
            return [a.name if a.name in FLOOR else "__init__" for a in node.names]
        if node.module.startswith("tokenmill."):
            return [node.module.split(".")[1]]
    return []


def _arrows() -> list[tuple[str, str, str, int]]:
    """(file, importer unit, imported unit, line) for every import of a tokenmill module."""
    out = []
    for path in sorted(SRC.rglob("*.py")):
        unit = _unit(path)
        for node in ast.walk(ast.parse(path.read_text())):
            out += [(str(path.relative_to(SRC)), unit, t, node.lineno) for t in _targets(node)]
    return out


def test_every_module_has_a_floor() -> None:
    units = {_unit(p) for p in SRC.rglob("*.py")}
    assert units - set(FLOOR) == set(), "place new modules on a floor (and in docs/ARCHITECTURE.md)"


def test_no_import_runs_up_a_floor() -> None:
    upward = [
        f"{file}:{line}: {unit} (floor {FLOOR[unit]}) imports {target} (floor {FLOOR[target]})"
        for file, unit, target, line in _arrows()
        if target in FLOOR and unit in FLOOR and FLOOR[target] > FLOOR[unit]
    ]
    assert upward == []


def test_the_check_sees_an_upward_arrow() -> None:
    """The reader finds imports at any depth and in both forms (a check that cannot fail is no check)."""
    tree = ast.parse("def f():\n    from tokenmill.server import app\n    import tokenmill.cli\n")
    found = [t for node in ast.walk(tree) for t in _targets(node)]
    assert found == ["server", "cli"]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_graph() -> dict[str, set[str]]:
    """Module -> the tokenmill modules it imports (lazy and type-checking imports too; ``from a import b`` reaches
    the module ``a.b`` when there is one, else ``a``)."""
    paths = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                reached = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                reached = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths else node.module
                           for a in node.names]  # fmt: skip
            else:
                continue
            graph[name] |= {r for r in reached if r in paths and r != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_reaches_itself_through_its_imports() -> None:
    """Within a floor too, imports between modules form no circle (a package's ``__init__`` counts as a module)."""
    assert _cycles(_module_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
