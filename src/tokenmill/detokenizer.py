"""Token ids -> streamed text, one step's delta at a time, with stop strings. Pure Python: no torch.

Two hold-backs keep every delta final (text once emitted is never retracted):

1. Partial characters. A multi-byte UTF-8 character can be split across tokens; decoding the first part
   alone ends in U+FFFD. Only a small window of tokens is decoded each step::

       window:  | tokens of the last delta | new tokens (or held ones) |
                |<- already emitted ------>|<- not yet emitted ------->|
                0                          read_offset
       delta = decode(window)[len(decode(window[:read_offset])):]

   and the delta waits while it ends in U+FFFD. Decoding the emitted window again (rather than the new
   tokens alone) keeps decoders that look at neighbours (SentencePiece's leading space) right.
2. Stop strings. The longest tail of the decoded text that is a proper prefix of some stop string is held
   until later text rules it out; when a stop string completes, text ends before it (or after it with
   ``include_stop_str_in_output``) and ``stop_string`` names it.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first output tokens, for leading-space decoders


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas. ``add`` per step, ``flush`` once at the end."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stops = [s for s in stop if s]
        self._max_held_chars = max((len(s) for s in self._stops), default=1) - 1
        self._include_stop = include_stop_str_in_output
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._window = context  # tokens decoded each step; trimmed as it slides
        self._read_offset = len(context)
        self._held = ""  # decoded, but could still be the start of a stop string
        self._pieces: list[str] = []  # emitted deltas; joined lazily so a step costs O(delta)
        self.stop_string: str | None = None  # the stop string that ended the text, once one has

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add(self, token_ids: list[int]) -> str:
        """Decode new tokens; return the text that is now final (may be empty). Nothing after a stop string."""
        if self.stop_string is not None or not token_ids:
            return ""
        self._window.extend(token_ids)
        return self._release(self._decode_new(final=False))

    def add_until_stop(self, token_ids: list[int]) -> tuple[str, int]:
        """``add`` for several tokens of one step (speculative decoding appends several): the text and how many of
        the tokens it took, up to the one that completed a stop string (those after it are not output)."""
        if len(token_ids) <= 1 or not self._stops:
            return self.add(token_ids), len(token_ids)
        text = ""
        for n, token in enumerate(token_ids):
            text += self.add([token])
            if self.stop_string is not None:
                return text, n + 1
        return text, len(token_ids)

    def flush(self) -> str:
        """Text still held back (a trailing partial character, a possible stop-string start). Call once at the end."""
        if self.stop_string is not None:
            return ""
        return self._release(self._decode_new(final=True), final=True)

    # --- decoding -----------------------------------------------------------------------------
    def _decode_new(self, final: bool) -> str:
        window = self._window
        if self._read_offset >= len(window):
            return ""
        decode = self._tokenizer.decode
        skip = self._skip_special_tokens
        emitted = decode(window[: self._read_offset], skip_special_tokens=skip)
        full = decode(window, skip_special_tokens=skip)
        if not final and (full.endswith(_REPLACEMENT_CHAR) or len(full) < len(emitted)):
            # A character is still incomplete. (A run of genuinely invalid bytes also waits here, exact
            # but with a growing window, until a valid character or flush() ends it.)
            return ""
        new_text = full[len(emitted) :]
        # Slide: the tokens just emitted become the window's emitted part.
        del window[: self._read_offset]
        self._read_offset = len(window)
        return new_text

    # --- stop strings -------------------------------------------------------------------------
    def _release(self, new_text: str, final: bool = False) -> str:
        buf = self._held + new_text
        if not buf:
            return ""
        if self._stops:
            match = _first_stop(buf, self._stops)
            if match is not None:
                stop, start = match
                self.stop_string = stop
                self._held = ""
                return self._emit(buf[: start + len(stop)] if self._include_stop else buf[:start])
        keep = 0 if final else _stop_prefix_len(buf, self._stops, self._max_held_chars)
        self._held = buf[len(buf) - keep :] if keep else ""
        return self._emit(buf[: len(buf) - keep])

    def _emit(self, delta: str) -> str:
        if delta:
            self._pieces.append(delta)
        return delta


def _first_stop(text: str, stops: list[str]) -> tuple[str, int] | None:
    """The stop string whose first occurrence ends earliest (ties: starts earliest), with its start."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop)
        if start < 0:
            continue
        key = (start + len(stop), start, stop)
        if best is None or key[:2] < best[:2]:
            best = key
    return None if best is None else (best[2], best[1])


def _stop_prefix_len(text: str, stops: list[str], max_len: int) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
    for n in range(min(max_len, len(text)), 0, -1):
        tail = text[-n:]
        if any(stop.startswith(tail) for stop in stops):
            return n
    return 0


__all__ = ["IncrementalDetokenizer"]
