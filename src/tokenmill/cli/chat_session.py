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
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from tokenmill.outputs import RequestMetrics

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
        pieces: list[str] = []
        metrics = None
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
                    pieces.append(delta.new_text)
                    self.out.write(delta.new_text)
                    self.out.flush()
                    if delta.finished:
                        metrics = delta.metrics
                        if delta.finish_reason == "abort":
                            self.out.write(" [stopped]")
        finally:
            signal.signal(signal.SIGINT, previous)
        self.out.write("\n")
        self.history += [
            {"role": "user", "content": user_text},
            {"role": "assistant", "content": "".join(pieces)},
        ]
        if self.stats and metrics is not None:
            self.out.write(format_stats(metrics) + "\n")
        self.out.flush()

    def _on_interrupt(self, signum: int, frame: FrameType | None) -> None:
        self._interrupted = True


def format_stats(metrics: RequestMetrics) -> str:
    """One answer's timings and counts (the engine's own, as ``--enable-per-request-metrics`` reports them)."""

    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"

    rate = f"{metrics.decode_tps:.1f} tokens/s" if metrics.decode_tps is not None else "- tokens/s"
    return (
        f"[{metrics.num_output_tokens} tokens, first token {ms(metrics.time_to_first_token_s)} "
        f"(queue {ms(metrics.queue_time_s)}, prefill {ms(metrics.prefill_time_s)}), "
        f"decode {ms(metrics.decode_time_s)} at {rate}; prompt {metrics.num_prompt_tokens} tokens, "
        f"{metrics.num_cached_tokens} cached; {metrics.num_preemptions} preemptions, "
        f"{metrics.num_recomputed_tokens} tokens recomputed]"
    )
