"""``tokenmill chat`` with no message: a conversation in the terminal.

Each turn sends the whole history through the model's chat template (prefix caching makes the repeated part
cheap: the earlier turns' KV blocks are found, not recomputed) and streams the answer as it comes. Commands:
``/exit``, ``/reset`` (forget the history), ``/system TEXT`` (set the system message and reset), ``/status``
(requests in flight and free KV blocks). Ctrl-C during an answer stops it (the request is aborted between
two engine steps, never inside one) and keeps what was said; Ctrl-C at the prompt clears the line; Ctrl-D
leaves with status 0.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, TextIO

HELP = "/exit, /reset, /system TEXT, /status; Ctrl-C stops an answer, Ctrl-D leaves"
PROMPT = ">>> "


@dataclass
class ChatSession:
    engine: Any
    params: Any  # SamplingParams of every answer
    system: str | None = None
    stats: bool = False
    show_prompt: bool = False
    out: TextIO = field(default_factory=lambda: sys.stdout)
    err: TextIO = field(default_factory=lambda: sys.stderr)
    history: list[dict[str, str]] = field(default_factory=list)
    _interrupted: bool = False

    def run(self) -> int:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
        name = getattr(self.engine, "model_name", "the model")
        self.out.write(f"tokenmill chat with {name}. {HELP}\n")
        self.out.flush()
        while True:
            try:
                line = input(PROMPT)
            except EOFError:  # Ctrl-D
                self.out.write("\n")
                return 0
            except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh line
                self.out.write("\n")
                continue
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                if self._command(text):
                    return 0
                continue
            self._answer(text)

    def _command(self, text: str) -> bool:
        """Run a /command; True when the session should end."""
        name, _, rest = text.partition(" ")
        if name in ("/exit", "/quit"):
            return True
        if name == "/reset":
            self.history = []
            self.out.write("[history cleared]\n")
        elif name == "/system":
            self.system = rest.strip() or None
            self.history = []
            self.out.write(
                "[system message set; history cleared]\n" if self.system else "[system message removed]\n"
            )
        elif name == "/status":
            engine = self.engine
            self.out.write(
                f"[{engine.num_running} running, {engine.num_waiting} waiting, {engine.num_free_blocks}/"
                f"{engine.num_total_blocks} KV blocks free, {len(self.history) // 2} turns in the history]\n"
            )
        else:
            self.out.write(f"[unknown command {name}: {HELP}]\n")
        self.out.flush()
        return False

    def messages(self, user_text: str) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, *self.history, {"role": "user", "content": user_text}]

    def _answer(self, user_text: str) -> None:
        engine = self.engine
        messages = self.messages(user_text)
        tokenizer = engine.tokenizer
        if self.show_prompt:
            self.err.write(f"[prompt]\n{tokenizer.apply_chat_template(messages)}\n[/prompt]\n")
            self.err.flush()
        try:
            request_id = engine.add_request(tokenizer.encode_chat(messages), self.params)
        except ValueError as exc:  # a conversation past the context: say so, keep the session
            self.out.write(f"[error: {exc}; /reset starts over]\n")
            return
        start = time.perf_counter()
        first_token_s: float | None = None
        num_tokens, pieces = 0, []
        self._interrupted = False
        previous = signal.signal(signal.SIGINT, self._on_interrupt)
        try:
            while engine.has_unfinished():
                if self._interrupted:
                    engine.abort(request_id)  # between steps; its final delta comes out of the next one
                    self._interrupted = False
                for delta in engine.step().deltas:
                    if delta.request_id != request_id:
                        continue
                    if delta.new_token_ids and first_token_s is None:
                        first_token_s = time.perf_counter() - start
                    num_tokens += len(delta.new_token_ids)
                    pieces.append(delta.new_text)
                    self.out.write(delta.new_text)
                    self.out.flush()
                    if delta.finished and delta.finish_reason == "abort":
                        self.out.write(" [stopped]")
        finally:
            signal.signal(signal.SIGINT, previous)
        self.out.write("\n")
        self.history += [
            {"role": "user", "content": user_text},
            {"role": "assistant", "content": "".join(pieces)},
        ]
        if self.stats:
            elapsed = time.perf_counter() - start
            decode_s = elapsed - (first_token_s or 0.0)
            rate = (num_tokens - 1) / decode_s if num_tokens > 1 and decode_s > 0 else 0.0
            ttft = f"{first_token_s * 1e3:.0f} ms" if first_token_s is not None else "-"
            self.out.write(f"[{num_tokens} tokens, first token {ttft}, {rate:.1f} tokens/s]\n")
        self.out.flush()

    def _on_interrupt(self, signum: int, frame: FrameType | None) -> None:
        self._interrupted = True
