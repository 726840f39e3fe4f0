"""What watches each request from the engine thread besides /metrics: the traffic recorder (``--record``) and
the tracer (``--otlp-traces-endpoint``).

The :class:`~tokenmill.server.async_engine.AsyncEngine` calls every observer on its engine thread: ``on_add``
when an engine request is accepted, ``on_step`` after each step, ``on_finish`` with each request's final delta
(exactly once per accepted request, a failed one included). An observer that raises is logged and dropped:
watching never costs a request.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

from tokenmill.outputs import RequestDelta
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill.server")

# The W3C trace-context headers of the HTTP request being handled (set by the app's middleware, read by
# AsyncEngine.submit, so no route has to pass them along).
current_trace_headers: ContextVar[dict[str, str] | None] = ContextVar("current_trace_headers", default=None)


@dataclass(frozen=True)
class AddedRequest:
    """An engine request as it was accepted (the engine thread's view)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    arrival_s: float  # the engine's clock (time.perf_counter)
    cache_salt: str | None = None
    trace_headers: Mapping[str, str] | None = None  # W3C traceparent / tracestate of the HTTP request


class RequestObserver(Protocol):
    def on_add(self, request: AddedRequest, now_s: float) -> None: ...

    def on_step(self, start_s: float, end_s: float, has_work: bool) -> None: ...

    def on_finish(self, request: AddedRequest, delta: RequestDelta) -> None: ...

    def close(self) -> None: ...


class Observers:
    """Several observers called as one; one that raises is logged and not called again."""

    def __init__(self, observers: Sequence[RequestObserver] = ()) -> None:
        self.observers = list(observers)

    def __bool__(self) -> bool:
        return bool(self.observers)

    def _each(self, method: str, *args: Any) -> None:
        for observer in list(self.observers):
            try:
                getattr(observer, method)(*args)
            except Exception:
                logger.exception("%s.%s failed; it is switched off", type(observer).__name__, method)
                self.observers.remove(observer)

    def on_add(self, request: AddedRequest, now_s: float) -> None:
        self._each("on_add", request, now_s)

    def on_step(self, start_s: float, end_s: float, has_work: bool) -> None:
        self._each("on_step", start_s, end_s, has_work)

    def on_finish(self, request: AddedRequest, delta: RequestDelta) -> None:
        self._each("on_finish", request, delta)

    def close(self) -> None:
        self._each("close")
