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
        "models",
        "tokenizer",
        "detokenizer",
        "engine_args",
        "traffic",
        "cost_model",
        "reasoning",
        "lora_request",
    },  # fmt: skip
    {"cache"},
    {"core", "stats", "roofline"},
    {"model", "structured_outputs"},
    {"worker"},
    {"engine"},
    {"llm", "system_info", "__init__"},
    {"server", "bench", "chat_session"},
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
