"""The ``tokenmill`` command: its parsers and commands (``commands.py``) and the terminal chat
(``chat_session.py``)."""

from tokenmill.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
