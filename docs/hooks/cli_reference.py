"""MkDocs hook: the CLI reference page written from tokenmill's own argparse parsers at build time, so the page
cannot drift from the flags. ``docs/cli.md`` holds the marker below; :func:`render` is what replaces it."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

MARKER = "<!-- cli-reference -->"


def render(parser: argparse.ArgumentParser, prefix: str = "tokenmill") -> str:
    """Every command below ``parser``, depth first: a heading, its help, then its flags by group."""
    out: list[str] = []
    _command(parser, prefix, "", out, level=2)
    return "\n".join(out) + "\n"


def _command(parser: argparse.ArgumentParser, name: str, help_text: str, out: list[str], level: int) -> None:
    if level > 2:
        out += [f"{'#' * level} `{name}`", ""]
        if help_text:
            out += [_escape(help_text), ""]
    for group in parser._action_groups:  # argparse keeps no public list of its groups
        rows = [_row(a) for a in group._group_actions if not isinstance(a, argparse._SubParsersAction)]
        rows = [r for r in rows if r]
        if rows:
            out += [
                f"**{group.title}**",
                "",
                "| flag | default | what it does |",
                "| --- | --- | --- |",
                *rows,
                "",
            ]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for sub_name, sub in action.choices.items():
                _command(sub, f"{name} {sub_name}", helps.get(sub_name, ""), out, level + 1)


def _row(action: argparse.Action) -> str | None:
    if isinstance(action, argparse._HelpAction):
        return None
    flag = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}` (positional)"
    if action.choices is not None and not isinstance(action.choices, dict):
        flag += " {" + ", ".join(str(c) for c in action.choices) + "}"
    default = action.default
    empty = default is None or default is False or default == argparse.SUPPRESS or default == []
    shown = "" if empty else f"`{default}`"
    return f"| {flag} | {shown} | {_escape(_help(action))} |"


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%" in text:
        params = {**vars(action), "prog": ""}
        with contextlib.suppress(KeyError, TypeError, ValueError):
            text = text % params
    return text


def _escape(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if MARKER not in markdown:
        return markdown
    from tokenmill.cli import build_parser

    return markdown.replace(MARKER, render(build_parser()))
