"""``tokenmill chat`` with no message, driven through a pseudo-terminal as a person would: two turns where the
second's prompt carries the first, ``/reset``, Ctrl-C during an answer (back at the prompt, nothing left
running, every KV block free), Ctrl-D (exit status 0)."""

from __future__ import annotations

import contextlib
import os
import pty
import re
import select
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")


class Terminal:
    def __init__(self, argv: list[str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal, so Ctrl-C is a SIGINT
            os.execv(argv[0], argv)
        self.buffer = ""

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def expect(self, pattern: str, timeout_s: float = 90.0) -> str:
        """Read until ``pattern`` (a regex) shows; return everything read up to the end of the match."""
        deadline = time.monotonic() + timeout_s
        regex = re.compile(pattern, re.S)
        while True:
            match = regex.search(self.buffer)
            if match:
                seen, self.buffer = self.buffer[: match.end()], self.buffer[match.end() :]
                return seen
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"timed out waiting for {pattern!r}; the terminal shows:\n{self.buffer[-3000:]}"
                )
            ready, _, _ = select.select([self.fd], [], [], min(left, 1.0))
            if ready:
                try:
                    self.buffer += os.read(self.fd, 65536).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    raise AssertionError(f"terminal closed; it showed:\n{self.buffer[-3000:]}") from None

    def wait(self, timeout_s: float = 30.0) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            try:
                select.select([self.fd], [], [], 0.2)
                os.read(self.fd, 65536)
            except OSError:
                pass
        os.kill(self.pid, 9)
        raise AssertionError("the chat session did not exit")


def _turn(term: Terminal, text: str) -> str:
    """Send a message, wait until the answer streams, stop it with Ctrl-C; the rendered prompt it used."""
    term.send(text + "\r")
    prompt = term.expect(r"\[prompt\](.*?)\[/prompt\]")
    term.expect(r"\S")  # the answer has begun (it would run to --max-tokens with --ignore-eos)
    term.send("\x03")
    term.expect(r"\[stopped\]")
    term.expect(re.escape(">>> "))
    return prompt


def test_interactive_session_keeps_history_resets_and_stops_on_ctrl_c() -> None:
    argv = [sys.executable, "-m", "tokenmill.cli", "chat", "--show-prompt", "--max-tokens", "4000",
            "--ignore-eos", "--temperature", "0", "--num-kv-blocks", "600", "--device", "cpu"]  # fmt: skip
    term = Terminal(argv)
    try:
        term.expect(re.escape(">>> "), timeout_s=180)
        first = _turn(term, "My name is Ada Lovelace.")
        assert "My name is Ada Lovelace." in first
        term.send("/status\r")
        status = term.expect(r"\[(\d+) running, (\d+) waiting, (\d+)/(\d+) KV blocks free, 1 turns")
        running, waiting, free, total = map(
            int, re.search(r"(\d+) running, (\d+) waiting, (\d+)/(\d+)", status).groups()
        )
        assert (running, waiting) == (0, 0) and free == total  # the stopped answer left nothing behind
        term.expect(re.escape(">>> "))
        second = _turn(term, "What is my name?")
        assert "My name is Ada Lovelace." in second and "What is my name?" in second  # the history went in
        assert second.count("<|im_start|>assistant") == 2  # the first (stopped) answer is in the history too
        term.send("/reset\r")
        term.expect(r"\[history cleared\]")
        term.expect(re.escape(">>> "))
        third = _turn(term, "Hello again.")
        assert "Ada" not in third and "Hello again." in third
        term.send("\x04")  # Ctrl-D at an empty prompt
        assert term.wait() == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(term.pid, 9)


def test_run_opens_the_same_session_by_an_ollama_name() -> None:
    """``tokenmill run smollm2:135m`` (the embedded model by Ollama's name, nothing to pull): the interactive
    session in a terminal, an answer streamed and stopped with Ctrl-C, then Ctrl-D ends it."""
    argv = [sys.executable, "-m", "tokenmill.cli", "run", "smollm2:135m", "--show-prompt", "--max-tokens",
            "2000", "--ignore-eos", "--num-kv-blocks", "300", "--device", "cpu"]  # fmt: skip
    term = Terminal(argv)
    try:
        term.expect(re.escape(">>> "), timeout_s=180)
        prompt = _turn(term, "Tell me about caches.")
        assert "Tell me about caches." in prompt and "<|im_start|>assistant" in prompt  # the chat template
        term.send("\x04")
        assert term.wait() == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(term.pid, 9)
