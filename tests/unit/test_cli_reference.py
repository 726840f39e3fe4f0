"""The CLI reference page (docs/cli.md) is written from the argparse parsers when the docs are built
(docs/hooks/cli_reference.py): every command and every flag appears in it, each flag with its help."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from tokenmill.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def _hook():
    spec = importlib.util.spec_from_file_location(
        "cli_reference", ROOT / "docs" / "hooks" / "cli_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _commands(parser: argparse.ArgumentParser, name: str = "tokenmill"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _commands(sub, f"{name} {sub_name}")


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
        and a.help != argparse.SUPPRESS
    ]


def test_every_command_and_flag_is_on_the_page() -> None:
    hook = _hook()
    page = (ROOT / "docs" / "cli.md").read_text()
    assert hook.MARKER in page
    rendered = hook.on_page_markdown(page, page=None)
    assert hook.MARKER not in rendered
    commands = list(_commands(build_parser()))
    assert {"tokenmill serve", "tokenmill bench replay", "tokenmill pull"} <= {name for name, _ in commands}
    for name, parser in commands[1:]:
        assert f"`{name}`" in rendered, name
        for action in _flags(parser):
            shown = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}` (positional)"
            assert shown in rendered, (name, shown)


def test_every_flag_says_what_it_does() -> None:
    unexplained = [
        (name, action.option_strings or action.dest)
        for name, parser in _commands(build_parser())
        for action in _flags(parser)
        if not (action.help or "").strip()
    ]
    assert not unexplained, unexplained


def test_a_table_row_keeps_its_cells() -> None:
    """A help text with a pipe or a line break stays in its cell."""
    parser = argparse.ArgumentParser(prog="x")
    sub = parser.add_subparsers().add_parser("y", help="the y\ncommand")
    sub.add_argument("--mode", default="a", choices=["a", "b"], help="a | b, one\nor the other")
    text = _hook().render(parser, prefix="x")
    row = next(line for line in text.splitlines() if "`--mode`" in line)
    assert row == "| `--mode` {a, b} | `a` | a \\| b, one or the other |"
    assert "### `x y`" in text and "the y command" in text
