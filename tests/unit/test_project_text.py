"""The shipped text speaks of the software, not of the history of its making: no issue numbers, numbered stops or
sessions of work in the README, the docs, the benchmarks' README, the sources' comments or the tests (names and
docstrings). A measurement keeps its date and CPU; history lives in git."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|[a-z]+teenth|twentieth"
)
HISTORY = re.compile(
    rf"\bissues? #?\d+|\btasks? \d+\b|\bstop \d+\b|\b(?:{ORDINALS}|this|last|next|previous|earlier|same) sessions?\b",
    re.IGNORECASE,
)
SUFFIXES = {".md", ".py", ".h", ".cpp", ".html", ".yml", ".yaml", ".toml", ".sh", ".cfg"}


def shipped_files() -> list[Path]:
    roots = [
        ROOT / "README.md",
        ROOT / "docs",
        ROOT / "benchmarks",
        ROOT / "src",
        ROOT / "tests",
        ROOT / "scripts",
    ]
    files: list[Path] = []
    for root in roots:
        candidates = [root] if root.is_file() else sorted(root.rglob("*"))
        files += [
            p for p in candidates if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts
        ]
    return [p for p in files if p != Path(__file__).resolve()]


def history_lines(text: str) -> list[str]:
    return [f"{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if HISTORY.search(line)]


@pytest.mark.parametrize(
    ("line", "is_history"),
    [
        ("## Instruction-set variants (fourth session, 2026-12-01)", True),
        ("as issue 25's targets asked", True),
        ("Stop 48's commits failed CI", True),
        ("measured earlier the same session", True),
        ("an interactive chat session; a pytest session fixture", False),
        ("the model's issue with long prompts", False),
        ("2026-12-05, Intel Xeon family 6 model 207", False),
    ],
)
def test_the_words_are_caught(line: str, is_history: bool) -> None:
    assert bool(history_lines(line)) is is_history


def test_shipped_text_has_no_history_words() -> None:
    files = shipped_files()
    assert len(files) > 100  # the walk found the tree
    found = {
        str(p.relative_to(ROOT)): lines
        for p in files
        if (lines := history_lines(p.read_text(encoding="utf-8", errors="replace")))
    }
    assert not found, found
