"""Per-request sampling options, validated on construction. Greedy is ``temperature == 0``.

Pure Python: imported by the scheduler, which must stay torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tokenmill.errors import BadRequestError


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output, vLLM's shape: exactly one of ``json`` (a JSON schema, as a dict or a JSON
    string), ``regex``, ``choice`` (the output is one of these strings), ``grammar`` (Lark, as llguidance
    reads it) or ``json_object=True`` (any JSON object)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    # a reasoning model's thought comes first, unconstrained, up to "</think>": "required" (the thought was
    # opened in the prompt, or the model always writes one) or "optional" (a "<think> ... </think>" may open
    # the output); None: the constraint starts at the first token
    after_think: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise BadRequestError(
                f"structured_outputs: give exactly one of json, regex, choice, grammar, json_object; got {given}",
                param="structured_outputs",
            )
        if self.after_think not in (None, "required", "optional"):
            raise BadRequestError(
                f"structured_outputs: after_think must be required or optional, got {self.after_think!r}",
                param="structured_outputs",
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise BadRequestError(
                "structured_outputs: choice must be a non-empty list of non-empty strings",
                param="structured_outputs",
            )

    @property
    def key(self) -> str:
        """A stable identity for the compiled-grammar cache."""
        import json

        return json.dumps(
            {"json": self.json, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
             "json_object": self.json_object, "after_think": self.after_think},
            sort_keys=True,
        )  # fmt: skip


@dataclass
class SamplingParams:
    """What one request wants generated, in the shape vLLM users know.

    Every field is checked in ``__post_init__``; a bad value raises ``ValueError`` naming the field.
    """

    max_tokens: int = 16  # 0: the prompt is prefilled and scored (prompt_logprobs), nothing sampled
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) means no top-k filter
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's plus the top k
    prompt_logprobs: int | None = None  # None: none; k >= 0: per prompt token (the first is None)
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # constrained decoding (llguidance)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        _check_int("max_tokens", self.max_tokens, lo=0)
        _check_float("temperature", self.temperature, lo=0.0)
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise BadRequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        _check_int("top_k", self.top_k, lo=-1)
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise BadRequestError(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")
        if self.seed is not None:
            _check_int("seed", self.seed)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not -2.0 <= value <= 2.0:
                raise BadRequestError(f"{name} must be in [-2, 2], got {value}", param=name)
        _check_float("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise BadRequestError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
                param="repetition_penalty",
            )
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.min_tokens > self.max_tokens:
            raise BadRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                param="min_tokens",
            )
        self._check_stops_and_biases()
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise BadRequestError(
                "structured_outputs must be a StructuredOutputsParams", param="structured_outputs"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, lo=0)
                if value > 20:
                    raise BadRequestError(f"{name} must be at most 20, got {value}", param=name)

    def _check_stops_and_biases(self) -> None:
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise BadRequestError(f"stop strings must be non-empty strings, got {s!r}", param="stop")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, lo=0)
        for tok, bias in self.logit_bias.items():
            if tok < 0:
                raise BadRequestError(
                    f"logit_bias keys must be token ids >= 0, got {tok}", param="logit_bias"
                )
            if not -100.0 <= bias <= 100.0:
                raise BadRequestError(
                    f"logit_bias values must be in [-100, 100], got {bias} for token {tok}",
                    param="logit_bias",
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _check_int(name: str, value: object, lo: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequestError(f"{name} must be an integer, got {value!r}", param=name)
    if lo is not None and value < lo:
        raise BadRequestError(f"{name} must be >= {lo}, got {value}", param=name)


def _check_float(name: str, value: object, lo: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequestError(f"{name} must be a number, got {value!r}", param=name)
    if math.isnan(value) or math.isinf(value):
        raise BadRequestError(f"{name} must be finite, got {value}", param=name)
    if lo is not None and value < lo:
        raise BadRequestError(f"{name} must be >= {lo}, got {value}", param=name)
