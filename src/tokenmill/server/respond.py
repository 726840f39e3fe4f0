"""The part of serving every API shares, written once: a request's engine group answered as one JSON body or as
an event stream, with the client's disconnect, the engine's failures and formatting bugs handled the same way.

Each API (``routes_completions.py``, ``routes_chat.py``, ``routes_responses.py``, ``routes_messages.py``) brings
a view: what its stream opens with, the event for one engine delta, what closes it (or ends it on a failure) and
the whole response. Everything else is here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.outputs import RequestDelta, RequestMetrics
from tokenmill.server.async_engine import ChoiceResult, RequestGroup, collect
from tokenmill.server.common import (
    SSE_DONE,
    ApiError,
    ClientGone,
    ServerState,
    SSEResponse,
    failure_for,
    sse,
    stream_failure,
    until_disconnect,
)
from tokenmill.server.protocol import PromptTokensDetails, UsageInfo

# A stream with nothing to say for this long (a long prompt's prefill, a full queue) sends the view's keep-alive:
# clients' first-byte and idle timers (Claude Code's 300 s watchdog, proxies' 60 s) never see a silent stream.
KEEPALIVE_S = 10.0
SSE_COMMENT_KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: every client skips it


class View(Protocol):
    """How one API writes its answers (per HTTP request). Events are ready SSE text (one or several events)."""

    def opening_events(self, num_choices: int) -> Iterable[str]: ...  # at once, before any delta

    def keepalive_event(self) -> str: ...  # when nothing else was sent for KEEPALIVE_S

    def event(self, index: int, delta: RequestDelta) -> str | None: ...  # one delta of choice ``index``

    # after the last delta; ``metrics`` (``--enable-per-request-metrics``) goes in the final event that carries usage
    def closing_events(self, num_completion_tokens: int, metrics: Any = None) -> Iterable[str]: ...

    def error_events(self, error: ApiError) -> Iterable[str]: ...  # instead of the closing ones, on a failure

    def response(self, results: list[ChoiceResult]) -> BaseModel: ...  # the whole answer, not streamed


class OpenAIView:
    """What OpenAI's chat and completions views share: the envelope of every object (id, created, model), usage
    (the prompt counted once for its n choices), the stream's chunks and the final usage chunk."""

    chunk_class: ClassVar[type[BaseModel]]  # the API's stream chunk model

    def __init__(
        self, state: ServerState, response_id: str, include_usage: bool, num_prompt_tokens: int
    ) -> None:
        self.tokenizer = state.async_engine.tokenizer
        self.model = state.served_model_name  # a view for a LoRA adapter's request sets its name
        self.id = response_id
        self.created = int(time.time())
        self.include_usage = include_usage
        self.num_prompt_tokens = num_prompt_tokens

    def num_cached_tokens(self) -> int:
        raise NotImplementedError

    def token_str(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    def usage(self, num_completion_tokens: int) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=num_completion_tokens,
            total_tokens=self.num_prompt_tokens + num_completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.num_cached_tokens()),
        )

    def envelope(self, num_completion_tokens: int) -> dict[str, Any]:
        """The fields of a whole response besides its choices."""
        return {
            "id": self.id,
            "created": self.created,
            "model": self.model,
            "usage": self.usage(num_completion_tokens),
        }

    def chunk(self, choice: Any) -> str:
        chunk = self.chunk_class(id=self.id, created=self.created, model=self.model, choices=[choice])
        return sse(chunk, exclude=None if self.include_usage else {"usage"})

    def closing_events(self, num_completion_tokens: int, metrics: Any = None) -> list[str]:
        """The usage chunk when it was asked for (or per-request metrics are on: they ride in it), then ``[DONE]``."""
        if not self.include_usage and metrics is None:
            return [SSE_DONE]
        usage = self.usage(num_completion_tokens)
        chunk = self.chunk_class(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)
        body = chunk.model_dump(exclude=None if self.include_usage else {"usage"})
        if metrics is not None:
            body["metrics"] = metrics
        return [sse(body), SSE_DONE]

    def error_events(self, error: ApiError) -> list[str]:
        return [error.sse_event(), SSE_DONE]

    def keepalive_event(self) -> str:
        return SSE_COMMENT_KEEPALIVE


async def respond(request: Request, state: ServerState, view: View, group: RequestGroup, stream: bool) -> Any:
    """The group's answer: an event stream, or (once every choice ended) one JSON body; 499 when the client left
    first; the engine's failure as its error (``stream_failure``)."""
    if stream:
        return SSEResponse(events(view, group, state), on_disconnect=group.abort)
    results = await wait_for_results(request, state, group)
    if isinstance(results, Response):
        return results
    body = view.response(results).model_dump()
    if state.enable_per_request_metrics:
        body["metrics"] = metrics_json([r.metrics for r in results])
    return JSONResponse(body)


def metrics_json(metrics: list[RequestMetrics | None]) -> dict[str, Any] | list[dict[str, Any]]:
    """``--enable-per-request-metrics``' object (``RequestMetrics.as_json``): one object for one choice, a list
    of them (each with its choice's ``index``) for several."""
    objects = [{} if m is None else m.as_json() for m in metrics]
    if len(objects) == 1:
        return objects[0]
    return [{"index": index, **obj} for index, obj in enumerate(objects)]


async def wait_for_results(
    request: Request, state: ServerState, group: RequestGroup
) -> list[ChoiceResult] | Response:
    """Every choice's result once all ended; a 499 response when the client left first (the group aborted); the
    engine's failure raised as its error (``stream_failure``)."""
    try:
        results = await until_disconnect(request, collect(group), group.abort)
    except ClientGone:
        return Response(status_code=499)
    failure = failure_for(state.async_engine, group, results)
    if failure is not None:
        raise failure
    return results


async def with_keepalives(source: AsyncIterator[Any], keepalive_s: float) -> AsyncIterator[Any]:
    """``source``'s items, and None whenever ``keepalive_s`` passes without one. The pending read is cancelled
    when the consumer stops (a client gone), so nothing is left waiting on the group."""
    pending: asyncio.Task[Any] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(source.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=keepalive_s)
            if not done:
                yield None
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()


async def events(
    view: View, group: RequestGroup, state: ServerState, keepalive_s: float = KEEPALIVE_S
) -> AsyncIterator[str]:
    """The stream: the view's opening events at once, an event per delta (a keep-alive when none came for
    ``keepalive_s``), its closing events; a failure (the engine's, or a bug while formatting) ends it with the
    view's error events instead."""
    num_completion_tokens = 0
    finished: dict[int, RequestMetrics | None] = {}
    try:
        for opening in view.opening_events(len(group.request_ids)):
            yield opening
        async for item in with_keepalives(group.stream(), keepalive_s):
            if item is None:
                yield view.keepalive_event()
                continue
            index, delta = item
            failure = stream_failure(state.async_engine, group, delta)
            if failure is not None:
                group.abort()
                for event in view.error_events(failure):
                    yield event
                return
            num_completion_tokens += len(delta.new_token_ids)
            if delta.finished:
                finished[index] = delta.metrics
            event = view.event(index, delta)
            if event is not None:
                yield event
        metrics = None
        if state.enable_per_request_metrics:
            metrics = metrics_json([finished.get(i) for i in range(len(group.request_ids))])
        closing = list(view.closing_events(num_completion_tokens, metrics))
    except Exception as exc:  # a bug while formatting: tell the client, then end the stream properly
        group.abort()
        closing = list(view.error_events(
            ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        ))  # fmt: skip
    for event in closing:
        yield event
