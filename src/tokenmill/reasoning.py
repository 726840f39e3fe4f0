"""A reasoning model's output split into its thinking and its answer (vLLM's ``--reasoning-parser``).

Models that think write ``<think> ... </think>`` before the answer. Two parsers, with vLLM's names and rules:

- ``deepseek_r1``: everything before ``</think>`` is reasoning (the opening tag is optional: the DeepSeek-R1
  distills' templates put it in the prompt); an output that never closes the tag is all reasoning.
- ``qwen3``: reasoning only where the output opens with ``<think>`` (or the prompt ended with it, as Qwen3's
  thinking-only templates do); otherwise, ``enable_thinking: false`` among them, all of it is the answer.

:func:`split` reads a whole text; :class:`StreamSplit` the same text as it grows, emitting only what can no
longer change: a tag cut anywhere by the stream is held until it is whole, and so is whitespace that may turn
out to trail the reasoning. The streamed pieces add up to :func:`split`'s answer for the whole text.
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING_PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


@dataclass(frozen=True)
class Split:
    reasoning: str | None  # None: the output did not think
    content: str


def split(parser: str, text: str, opened_in_prompt: bool = False) -> Split:
    """The whole output ``text`` as reasoning and answer, by ``parser``'s rules."""
    reasoning, content, _ = _parts(parser, text, opened_in_prompt, final=True)
    return Split(reasoning, content)


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside an open ``<think>`` (the template wrote the opening tag)."""
    tail = prompt_text.rstrip()
    return tail.endswith(START)


class StreamSplit:
    """One choice's output as it streams: ``feed(new_text)`` returns the new reasoning and answer text that
    can be sent now; ``feed("", final=True)`` the rest."""

    def __init__(self, parser: str, opened_in_prompt: bool = False) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, got {parser!r}"
            )
        self.parser = parser
        self.opened_in_prompt = opened_in_prompt
        self.text = ""
        self.num_sent_reasoning = 0
        self.num_sent_content = 0
        self.thought = False  # whether any reasoning was found (the answer then says so even if empty)

    def feed(self, new_text: str, final: bool = False) -> tuple[str, str]:
        self.text += new_text
        reasoning, content, _ = _parts(self.parser, self.text, self.opened_in_prompt, final)
        self.thought = self.thought or reasoning is not None
        reasoning = reasoning or ""
        out = reasoning[self.num_sent_reasoning :], content[self.num_sent_content :]
        self.num_sent_reasoning, self.num_sent_content = len(reasoning), len(content)
        return out


def _parts(parser: str, text: str, opened_in_prompt: bool, final: bool) -> tuple[str | None, str, bool]:
    """(reasoning or None, answer, whether the reasoning has ended), each the part that is certain: unless
    ``final``, a possible partial tag and whitespace that may trail the reasoning are left out."""
    body = text.lstrip()
    if not final and START.startswith(body) and body != START:
        return None, "", False  # nothing yet, or "<thi": it may still open
    opened = opened_in_prompt or parser == "deepseek_r1"
    if body.startswith(START):
        body, opened = body[len(START) :], True
    elif not opened:
        return None, text, False
    end = body.find(END)
    if end >= 0:
        return body[:end].strip(), body[end + len(END) :].lstrip(), True
    if final:
        return body.strip(), "", False
    # inside the reasoning: hold a suffix that may start "</think>", and trailing whitespace
    held = next((n for n in range(min(len(END) - 1, len(body)), 0, -1) if END.startswith(body[-n:])), 0)
    return body[: len(body) - held].strip(), "", False
