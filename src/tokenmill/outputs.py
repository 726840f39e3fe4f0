"""What the engine hands back: per-step deltas (for streaming) and whole results (vLLM's shapes). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class Logprob:
    """One output position's log-probabilities, from the model's raw distribution."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class RequestMetrics:
    arrival_time_s: float
    first_token_time_s: float | None
    last_token_time_s: float | None
    finished_time_s: float | None
    num_preemptions: int

    @classmethod
    def of(cls, request: Any) -> RequestMetrics:
        """A request's timestamps and preemption count (a :class:`tokenmill.request.Request`: same names)."""
        return cls(**{f.name: getattr(request, f.name) for f in fields(cls)})


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    logprobs: list[Logprob] | None = None
    error: str | None = None
    error_kind: str | None = None  # with error: one of tokenmill.errors.ERROR_KINDS

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # per prompt token: None for the first, else Logprob of that token given the ones before
    prompt_logprobs: list[Logprob | None] | None = None
    embedding: list[float] | None = None  # an embedding model's pooled vector for the prompt


@dataclass
class RequestDelta:
    """What one step added to one request: stream these to a caller."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    error_kind: str | None = None  # with error: one of tokenmill.errors.ERROR_KINDS
    new_logprobs: list[Logprob] | None = None  # parallel to new_token_ids when logprobs were asked
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # total so far, including new_token_ids
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served at admission
    prompt_logprobs: list[Logprob | None] | None = None  # on the first delta only, when asked
    embedding: list[float] | None = None  # an embedding model's vector, on the final delta
    extra: dict[str, Any] = field(default_factory=dict)
