"""The part of serving every API shares, written once: a request's engine group answered as one JSON body or as
an event stream, with the client's disconnect, the engine's failures and formatting bugs handled the same way.

Each API (``routes_completions.py``, ``routes_chat.py``) brings a view: what its stream opens with, the event
for one engine delta, the usage event and the whole response. Everything else is here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any, Protocol

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.outputs import RequestDelta
from tokenmill.server.async_engine import ChoiceResult, RequestGroup, collect
from tokenmill.server.common import (
    SSE_DONE,
    ApiError,
    ClientGone,
    ServerState,
    SSEResponse,
    failure_for,
    stream_failure,
    until_disconnect,
)


class View(Protocol):
    """How one API writes its answers (per HTTP request)."""

    include_usage: bool

    def opening_events(self, num_choices: int) -> Iterable[str]: ...  # before any delta (chat: the roles)

    def event(self, index: int, delta: RequestDelta) -> str | None: ...  # one delta of choice ``index``

    def usage_event(self, num_completion_tokens: int) -> str: ...  # the last event, when usage was asked

    def response(self, results: list[ChoiceResult]) -> BaseModel: ...  # the whole answer, not streamed


async def respond(request: Request, state: ServerState, view: View, group: RequestGroup, stream: bool) -> Any:
    """The group's answer: an event stream, or (once every choice ended) one JSON body; 499 when the client left
    first; the engine's failure as its error (``stream_failure``)."""
    if stream:
        return SSEResponse(events(view, group, state), on_disconnect=group.abort)
    try:
        results = await until_disconnect(request, collect(group), group.abort)
    except ClientGone:
        return Response(status_code=499)
    failure = failure_for(state.async_engine, group, results)
    if failure is not None:
        raise failure
    return JSONResponse(view.response(results).model_dump())


async def events(view: View, group: RequestGroup, state: ServerState) -> AsyncIterator[str]:
    """The stream: the view's opening events, an event per delta, the usage event; a failure ends it with one
    error event, then ``[DONE]`` always."""
    num_completion_tokens = 0
    try:
        for opening in view.opening_events(len(group.request_ids)):
            yield opening
        async for index, delta in group.stream():
            failure = stream_failure(state.async_engine, group, delta)
            if failure is not None:
                group.abort()
                yield failure.sse_event()
                break
            num_completion_tokens += len(delta.new_token_ids)
            event = view.event(index, delta)
            if event is not None:
                yield event
        else:
            if view.include_usage:
                yield view.usage_event(num_completion_tokens)
    except Exception as exc:  # a bug while formatting: tell the client, then end the stream properly
        group.abort()
        yield ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").sse_event()
    yield SSE_DONE
