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
    """One request's timestamps (the engine's clock, seconds) and counts, and the timings made of them.

    ``queue + prefill + decode`` is arrival to the last token; ``e2e`` is arrival to the finish, the same
    instant for a request that stopped or hit its length (the step that made its last token ended it)::

        arrival -- queue --> first scheduled -- prefill --> first token -- decode --> last token (= finished)
    """

    arrival_time_s: float
    first_scheduled_time_s: float | None
    first_token_time_s: float | None
    last_token_time_s: float | None
    finished_time_s: float | None
    num_preemptions: int
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served at the first admission
    num_output_tokens: int = 0
    num_recomputed_tokens: int = 0  # tokens computed again after preemptions
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0

    @classmethod
    def of(cls, request: Any) -> RequestMetrics:
        """A request's timestamps and counts (a :class:`tokenmill.request.Request`: same names)."""
        return cls(**{f.name: getattr(request, f.name) for f in fields(cls)})

    @staticmethod
    def _span(start: float | None, end: float | None) -> float | None:
        return None if start is None or end is None else end - start

    @property
    def queue_time_s(self) -> float | None:
        """Arrival to the first admission (to the finish, for one aborted while it waited)."""
        end = self.first_scheduled_time_s if self.first_scheduled_time_s is not None else self.finished_time_s
        return self._span(self.arrival_time_s, end)

    @property
    def prefill_time_s(self) -> float | None:
        """First admission to the first token (the prompt's forwards; a preemption's wait falls in decode)."""
        return self._span(self.first_scheduled_time_s, self.first_token_time_s)

    @property
    def decode_time_s(self) -> float | None:
        """First token to last token."""
        return self._span(self.first_token_time_s, self.last_token_time_s)

    @property
    def time_to_first_token_s(self) -> float | None:
        """Arrival to the first token (queue + prefill), what the client waits for."""
        return self._span(self.arrival_time_s, self.first_token_time_s)

    @property
    def e2e_time_s(self) -> float | None:
        return self._span(self.arrival_time_s, self.finished_time_s)

    @property
    def mean_itl_s(self) -> float | None:
        """Mean time between successive tokens after the first."""
        decode = self.decode_time_s
        return (
            decode / (self.num_output_tokens - 1)
            if decode is not None and self.num_output_tokens > 1
            else None
        )

    @property
    def decode_tps(self) -> float | None:
        """Tokens after the first per second of decode."""
        decode = self.decode_time_s
        return (self.num_output_tokens - 1) / decode if decode and self.num_output_tokens > 1 else None

    @property
    def prefill_tps(self) -> float | None:
        """Prompt tokens computed (not served by the prefix cache) per second of prefill."""
        prefill = self.prefill_time_s
        return (self.num_prompt_tokens - self.num_cached_tokens) / prefill if prefill else None

    def as_json(self) -> dict[str, Any]:
        """The wire form (``--enable-per-request-metrics``): times in milliseconds, rates per second, counts."""

        def ms(seconds: float | None) -> float | None:
            return None if seconds is None else round(seconds * 1000.0, 3)

        def rate(value: float | None) -> float | None:
            return None if value is None else round(value, 3)

        return {
            "queue_time_ms": ms(self.queue_time_s),
            "prefill_time_ms": ms(self.prefill_time_s),
            "decode_time_ms": ms(self.decode_time_s),
            "time_to_first_token_ms": ms(self.time_to_first_token_s),
            "e2e_time_ms": ms(self.e2e_time_s),
            "mean_itl_ms": ms(self.mean_itl_s),
            "tokens_per_second": rate(self.decode_tps),
            "prefill_tokens_per_second": rate(self.prefill_tps),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "num_output_tokens": self.num_output_tokens,
            "num_preemptions": self.num_preemptions,
            "num_recomputed_tokens": self.num_recomputed_tokens,
            "num_spec_draft_tokens": self.num_spec_draft_tokens,
            "num_spec_accepted_tokens": self.num_spec_accepted_tokens,
        }


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
    metrics: RequestMetrics | None = None  # on the final delta: the request's timings and counts
    extra: dict[str, Any] = field(default_factory=dict)
