"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request becomes a chat request (``protocol_responses.to_chat``) and goes through ``routes_chat.plan_chat``,
so it shares the chat path's template, tools, forced-call grammar, constraints and sampling. The answer is a
``response`` object whose output items are a message (``output_text``) and/or ``function_call`` items; streamed,
it is OpenAI's typed event sequence (``response.created`` ... ``response.completed``, each with its
``sequence_number``). With ``store`` (the default, as OpenAI's) the response and its conversation are kept in
the server's bounded :class:`~tokenmill.server.response_store.ResponseStore`, so ``previous_response_id`` can
continue from it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response

from tokenmill.outputs import Logprob, RequestDelta
from tokenmill.server.async_engine import ChoiceResult, RequestGroup
from tokenmill.server.common import (
    ApiError,
    ServerState,
    answering_model,
    api_error,
    get_state,
    key_owner,
    parse_request,
    request_body,
    submit,
    tokenize_off_loop,
)
from tokenmill.server.protocol import ParamError
from tokenmill.server.protocol_responses import (
    InputItem,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    parse_items,
    to_chat,
)
from tokenmill.server.respond import SSE_COMMENT_KEEPALIVE, respond
from tokenmill.server.response_store import ResponseStoreError, StoredResponse
from tokenmill.server.routes_chat import Reasoning, plan_chat, reasoning_for
from tokenmill.server.tool_calls import parse as parse_tool_calls
from tokenmill.server.tool_calls import streamable_prefix

router = APIRouter()


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    what = "Previous response" if param == "previous_response_id" else "Response"
    code = "previous_response_not_found" if param == "previous_response_id" else "not_found"
    return ApiError(404, f"{what} with id '{response_id}' not found.", param=param, code=code)


@router.post("/v1/responses", openapi_extra=request_body(ResponsesRequest))
async def create_response(request: Request) -> Response:
    state, req = await parse_request(request, ResponsesRequest)
    view, group = await begin_response(request, state, req)
    response = await respond(request, state, view, group, bool(req.stream))
    dropped = req.offered_tools().dropped
    if dropped and isinstance(response, Response):  # built-in tools the model answered without
        response.headers[DROPPED_TOOLS_HEADER] = ",".join(dropped)
    return response


async def begin_response(
    conn: HTTPConnection,
    state: ServerState,
    req: ResponsesRequest,
    remembered: Mapping[str, list[dict[str, Any]]] | None = None,
) -> tuple[_ResponsesView, RequestGroup]:
    """A request checked, the conversation it continues found (a WebSocket's ``remembered`` responses first,
    then the store), its prompt planned and submitted: its view and engine group."""
    try:
        req.check()
        history: list[InputItem] = []
        if req.previous_response_id is not None:
            earlier = None if remembered is None else remembered.get(req.previous_response_id)
            if earlier is None:
                stored = await _stored(conn, req.previous_response_id)
                if stored is None:
                    raise _not_found(req.previous_response_id, "previous_response_id")
                earlier = stored.conversation
            history = parse_items(earlier, param="previous_response_id")
        chat = to_chat(req, history)
        plan = await tokenize_off_loop(plan_chat, state, chat)
    except ParamError as exc:
        raise _renamed(exc) from None
    response_id = f"resp_{uuid.uuid4().hex}"
    if req.generate is False:  # a warm-up: the prompt's prefill only, its blocks left in the prefix cache
        plan.engine_prompts = [
            (ids, replace(p, max_tokens=0, structured_outputs=None)) for ids, p in plan.engine_prompts
        ]
    group = await submit(
        state, plan.engine_prompts, response_id, req.cache_salt,
        structured_param="tools" if chat.forces_tool_call else ("text.format" if plan.structured_param else None),
        model=req.model,
    )  # fmt: skip
    conversation = [item.model_dump(exclude_none=True) for item in history + req.input_items()]
    view = _ResponsesView(state, req, response_id, len(plan.prompt_ids), conversation, key_owner(conn))
    view.reasoning = reasoning_for(state, chat, plan.prompt_ids)
    return view, group


DROPPED_TOOLS_HEADER = "x-tokenmill-dropped-tools"  # built-in tools (web_search ...) left out as optional

# chat fields a translated request may be refused under -> the Responses field the client sent
_CHAT_TO_RESPONSES = {
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
    "top_logprobs": "top_logprobs",
}


def _renamed(exc: ParamError) -> ApiError:
    param = _CHAT_TO_RESPONSES.get(exc.param or "", exc.param)
    message = exc.message
    if exc.param and param != exc.param:
        message = message.replace(exc.param, param or "", 1)
    return api_error(ParamError(message, param=param, code=exc.code))


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str) -> Response:
    _refuse_query(request)
    stored = await _stored(request, response_id)
    if stored is None:
        raise _not_found(response_id)
    return JSONResponse(stored.response)


async def _stored(request: HTTPConnection, response_id: str) -> StoredResponse | None:
    """The stored response if this request's API key stored it (off the event loop: the store may be a file
    or a server); a store that fails is a 503 saying so."""
    stored: StoredResponse | None = await _in_store(request, "get", response_id)
    return stored


async def _in_store(request: HTTPConnection, operation: str, response_id: str) -> Any:
    """``store.get`` or ``store.delete`` for this request's key, off the event loop (the store may be a file
    or a server); a store that fails is a 503 saying so."""
    method = getattr(get_state(request).response_store, operation)
    try:
        return await run_in_threadpool(method, response_id, key_owner(request))
    except ResponseStoreError as exc:
        raise ApiError(
            503, f"the response store failed: {exc}", type="server_error", code="response_store_error"
        ) from None


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(request: Request, response_id: str) -> Response:
    """The items that were this response's input, its chain's earlier turns included (what the model saw besides
    ``instructions``), as OpenAI's list: ``limit`` (1-100, 20), ``order`` (``desc``, the default, or ``asc``),
    ``after`` (an item id); ``include`` is refused (nothing it names is kept)."""
    query = request.query_params
    for name in query:
        if name not in ("limit", "order", "after"):
            raise ApiError.bad_request(f"query parameter {name!r} is not supported", param=name)
    limit_text = query.get("limit", "20")
    # ASCII digits only: str.isdigit() takes "²" (int() refuses it) and a 5,000-digit int() raises
    if (
        not (limit_text.isascii() and limit_text.isdigit() and len(limit_text) <= 3)
        or not 1 <= int(limit_text) <= 100
    ):
        raise ApiError.bad_request(
            f"limit must be an integer from 1 to 100, got {limit_text[:20]!r}", param="limit"
        )
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError.bad_request(f"order must be 'asc' or 'desc', got {order!r}", param="order")
    stored = await _stored(request, response_id)
    if stored is None:
        raise _not_found(response_id)
    num_inputs = len(stored.conversation) - len(stored.response.get("output") or [])
    items = [_listed_item(item, response_id, i) for i, item in enumerate(stored.conversation[:num_inputs])]
    if order == "desc":
        items.reverse()
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise ApiError.bad_request(
                f"after: no input item {after!r} in response {response_id!r}", param="after"
            )
        items = items[ids.index(after) + 1 :]
    page = items[: int(limit_text)]
    return JSONResponse({
        "object": "list", "data": page, "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page),
    })  # fmt: skip


def _listed_item(item: dict[str, Any], response_id: str, index: int) -> dict[str, Any]:
    """A stored input item as OpenAI lists it: a type, an id (given one where the client sent none), a message's
    text as content parts."""
    out = dict(item)
    out.setdefault("type", "message")
    out.setdefault(
        "id", f"{'msg' if out['type'] == 'message' else 'item'}_{response_id.removeprefix('resp_')}_{index}"
    )
    if out["type"] == "message" and isinstance(out.get("content"), str):
        kind = "output_text" if out.get("role") == "assistant" else "input_text"
        out["content"] = [{"type": kind, "text": out["content"]}]
    return out


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    _refuse_query(request)
    if not await _in_store(request, "delete", response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _refuse_query(request: Request) -> None:
    for name in request.query_params:  # stream/include/starting_after replay a background response: none here
        raise ApiError.bad_request(f"query parameter {name!r} is not supported", param=name)


class _ResponsesView:
    """One request's response object, whole or as OpenAI's event stream (n is always 1)."""

    def __init__(
        self, state: ServerState, req: ResponsesRequest, response_id: str, num_prompt_tokens: int,
        conversation: list[dict[str, Any]], owner: str = "",
    ) -> None:  # fmt: skip
        self.state = state
        self.owner = owner  # the API key's digest: only it reads the stored response back
        self.req = req
        self.id = response_id
        self.created_at = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        self.conversation = conversation
        offered = req.offered_tools()
        self.tool_names = {t.name for t in offered.functions} if req.tool_choice != "none" else set()
        self.namespaces = offered.namespaces  # qualified name -> (namespace, name)
        self.parser = state.tool_call_parser
        self.sequence_number = 0
        # streaming state
        self.text = ""
        self.sent = 0  # characters of text streamed as output_text deltas
        self.token_ids: list[int] = []
        self.logprob_entries: list[Logprob] = []
        self.message_id: str | None = None  # the open message item, once text has started
        # called with the id and the whole conversation (input and output) of the finished response, stored or
        # not: a WebSocket keeps its store-less responses for its own continuations
        self.remember: Callable[[str, list[dict[str, Any]]], None] | None = None
        # --reasoning-parser: the thinking as a reasoning item before the message (output_index 0)
        self.reasoning: Reasoning | None = None
        self.reasoning_id: str | None = None  # the reasoning item, once it has started
        self.reasoning_text = ""
        self.reasoning_done = False
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None

    # --- the response object ---------------------------------------------------------------------------
    def response_object(self, status: str, output: list[dict[str, Any]], num_output_tokens: int | None,
                        finish_reason: str | None = None, error: dict[str, Any] | None = None) -> ResponseObject:  # fmt: skip
        req = self.req
        fmt = (
            req.text.format.model_dump(exclude_none=True, by_alias=True)
            if req.text and req.text.format
            else {"type": "text"}
        )
        if finish_reason == "length" and status == "completed":
            status = "incomplete"
        usage = None
        if num_output_tokens is not None:
            usage = ResponseUsage(
                input_tokens=self.num_prompt_tokens,
                input_tokens_details={"cached_tokens": self.num_cached_tokens},
                output_tokens=num_output_tokens,
                output_tokens_details={"reasoning_tokens": 0},
                total_tokens=self.num_prompt_tokens + num_output_tokens,
            )
        tool_choice: Any = req.tool_choice or "auto"
        if not isinstance(tool_choice, str):
            tool_choice = tool_choice.model_dump()
        return ResponseObject(
            id=self.id, created_at=self.created_at, status=status, error=error,  # type: ignore[arg-type]
            incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            model=answering_model(self.state, req.model), output=output,
            parallel_tool_calls=True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            previous_response_id=req.previous_response_id, store=req.store is not False,
            temperature=req.temperature, text={"format": fmt}, tool_choice=tool_choice,
            tools=[t for t in req.tools or [] if t.get("type") in ("function", "namespace")], top_p=req.top_p,
            top_logprobs=req.top_logprobs, usage=usage, user=req.user, metadata=req.metadata or {},
        )  # fmt: skip

    @property
    def message_index(self) -> int:
        return 0 if self.reasoning_id is None else 1

    def reasoning_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        if self.reasoning_id is None:
            self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
        return {
            "type": "reasoning",
            "id": self.reasoning_id,
            "summary": [],
            "content": content,
            "status": status,
        }

    def reasoning_events(self, piece: str) -> str:
        """``piece`` of the thinking as a reasoning_text delta, the reasoning item opened first if need be."""
        out = ""
        if self.reasoning_id is None:
            out += self.sse(
                "response.output_item.added", output_index=0, item=self.reasoning_item("", "in_progress")
            )
            out += self.sse("response.content_part.added", item_id=self.reasoning_id, output_index=0,
                            content_index=0, part={"type": "reasoning_text", "text": ""})  # fmt: skip
        self.reasoning_text += piece
        return out + self.sse("response.reasoning_text.delta", item_id=self.reasoning_id, output_index=0,
                              content_index=0, delta=piece)  # fmt: skip

    def close_reasoning(self) -> str:
        """The reasoning item's closing events (once, when the answer starts or the stream ends)."""
        if self.reasoning_id is None or self.reasoning_done:
            return ""
        self.reasoning_done = True
        item = self.reasoning_item(self.reasoning_text)
        return (
            self.sse("response.reasoning_text.done", item_id=self.reasoning_id, output_index=0, content_index=0,
                     text=self.reasoning_text)
            + self.sse("response.content_part.done", item_id=self.reasoning_id, output_index=0, content_index=0,
                       part=item["content"][0])
            + self.sse("response.output_item.done", output_index=0, item=item)
        )  # fmt: skip

    def message_item(
        self, text: str, logprobs: list[dict[str, Any]], status: str = "completed"
    ) -> dict[str, Any]:
        if self.message_id is None:
            self.message_id = f"msg_{uuid.uuid4().hex}"
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if self.req.wants_logprobs:
            part["logprobs"] = logprobs
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": [part],
        }

    def call_item(self, call: Any, status: str = "completed", arguments: str | None = None) -> dict[str, Any]:
        item = {
            "type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id,
            "name": self.call_name(call), "arguments": call.arguments if arguments is None else arguments,
            "status": status,
        }  # fmt: skip
        if call.name in self.namespaces:  # a namespace tool's function: its own name and its namespace
            item["namespace"] = self.namespaces[call.name][0]
        return item

    def call_name(self, call: Any) -> str:
        return self.namespaces[call.name][1] if call.name in self.namespaces else str(call.name)

    def logprobs(self, token_ids: list[int], entries: list[Logprob]) -> list[dict[str, Any]]:
        out = []
        for token_id, entry in zip(token_ids, entries):
            token = self.token_str(token_id)
            top = [{"token": (s := self.token_str(t)), "logprob": lp, "bytes": list(s.encode())}
                   for t, lp in entry.top_logprobs]  # fmt: skip
            out.append(
                {"token": token, "logprob": entry.logprob, "bytes": list(token.encode()), "top_logprobs": top}
            )
        return out

    def token_str(self, token_id: int) -> str:
        return str(self.state.async_engine.tokenizer.decode([token_id], skip_special_tokens=False))

    def split(self, text: str) -> tuple[str, list[Any]]:
        """The answer's text and its function calls (parsed out when tools were offered)."""
        if not self.tool_names:
            return text, []
        content, calls = parse_tool_calls(text, self.parser, self.tool_names)
        if self.req.parallel_tool_calls is False:
            calls = calls[:1]  # at most one call per turn
        return (content or "") if calls else text, calls

    def store(self, response: ResponseObject) -> None:
        """Keep the response for its key; one the store could not keep says ``store: false``."""
        body = response.model_dump()
        conversation = self.conversation + [dict(i) for i in body["output"]]
        if self.remember is not None:
            self.remember(self.id, conversation)
        if self.req.store is False:
            return
        if not self.state.response_store.put(body, conversation, self.owner):
            response.store = False

    # --- respond.View: whole -------------------------------------------------------------------------------
    def response(self, results: list[ChoiceResult]) -> ResponseObject:
        (result,) = results
        self.num_cached_tokens = result.num_cached_tokens
        text, output = result.text, list[dict[str, Any]]()
        if self.reasoning is not None:
            thought, text = self.reasoning.whole(text)
            if thought is not None:
                output.append(self.reasoning_item(thought))
        content, calls = self.split(text)
        if (content or not calls) and self.req.generate is not False:
            logprobs = self.logprobs(result.token_ids, result.logprobs) if self.req.wants_logprobs else []
            output.append(self.message_item(content, logprobs, item_status(result.finish_reason)))
        output.extend(self.call_item(c) for c in calls)
        finish = None if self.req.generate is False else result.finish_reason
        response = self.response_object("completed", output, len(result.token_ids), finish)
        self.store(response)
        return response

    # --- respond.View: streamed ----------------------------------------------------------------------------
    def sse(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def opening_events(self, num_choices: int) -> list[str]:
        body = self.response_object("in_progress", [], None).model_dump()
        return [self.sse("response.created", response=body), self.sse("response.in_progress", response=body)]

    def text_events(self, piece: str, logprobs: list[dict[str, Any]]) -> str:
        """``piece`` as an output_text delta, the message item and its part opened first if need be."""
        out = self.close_reasoning()  # the answer follows the thinking
        at = self.message_index
        if self.message_id is None:
            item = self.message_item("", [], status="in_progress")
            out += self.sse("response.output_item.added", output_index=at, item=item)
            part = {"type": "output_text", "text": "", "annotations": []}
            out += self.sse("response.content_part.added", item_id=self.message_id, output_index=at,
                            content_index=0, part=part)  # fmt: skip
        if piece or logprobs:
            out += self.sse("response.output_text.delta", item_id=self.message_id, output_index=at,
                            content_index=0, delta=piece, logprobs=logprobs)  # fmt: skip
        return out

    def event(self, index: int, delta: RequestDelta) -> str | None:
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        self.token_ids.extend(delta.new_token_ids)
        self.logprob_entries.extend(delta.new_logprobs or [])
        thinking, new_text = "", delta.new_text
        if self.reasoning is not None:  # the thinking streams as the reasoning item, the rest as below
            thought, new_text = self.reasoning.piece(0, new_text, delta.finished)
            thinking = self.reasoning_events(thought) if thought else ""
        self.text += new_text
        if delta.finished:
            self.finish_reason = delta.finish_reason
        ready = len(self.text) if not self.tool_names else streamable_prefix(self.text, self.parser)
        if ready <= self.sent:
            return thinking or None
        piece, self.sent = self.text[self.sent : ready], ready
        logprobs = []
        if self.req.wants_logprobs and not self.tool_names:
            logprobs = self.logprobs(delta.new_token_ids, delta.new_logprobs or [])
        return thinking + self.text_events(piece, logprobs)

    def closing_events(self, num_completion_tokens: int, metrics: Any = None) -> list[str]:
        content, calls = self.split(self.text)
        out = [closing] if (closing := self.close_reasoning()) else []
        warming = self.req.generate is False  # a warm-up makes no output item
        if not warming and (
            not calls and len(self.text) > self.sent or (not calls and self.message_id is None)
        ):
            out.append(self.text_events(self.text[self.sent :], []))
            self.sent = len(self.text)
        output: list[dict[str, Any]] = (
            [] if self.reasoning_id is None else [self.reasoning_item(self.reasoning_text)]
        )
        at = self.message_index
        if self.message_id is not None:
            streamed = self.text[: self.sent]
            text = content if not calls else streamed.rstrip()
            logprobs = (
                self.logprobs(self.token_ids, self.logprob_entries)
                if self.req.wants_logprobs and not calls
                else []
            )
            item = self.message_item(text, logprobs, item_status(self.finish_reason))
            out.append(self.sse("response.output_text.done", item_id=self.message_id, output_index=at,
                                content_index=0, text=text, logprobs=logprobs))  # fmt: skip
            out.append(self.sse("response.content_part.done", item_id=self.message_id, output_index=at,
                                content_index=0, part=item["content"][0]))  # fmt: skip
            out.append(self.sse("response.output_item.done", output_index=at, item=item))
            output.append(item)
        for call in calls:
            index = len(output)
            item = self.call_item(call)
            out.append(self.sse("response.output_item.added", output_index=index,
                                item=self.call_item(call, "in_progress", arguments="")))  # fmt: skip
            out.append(self.sse("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=index, delta=call.arguments))  # fmt: skip
            out.append(self.sse("response.function_call_arguments.done", item_id=item["id"],
                                output_index=index, name=self.call_name(call), arguments=call.arguments))  # fmt: skip
            out.append(self.sse("response.output_item.done", output_index=index, item=item))
            output.append(item)
        finish = None if warming else self.finish_reason  # a warm-up ends complete at its 0 tokens
        response = self.response_object("completed", output, num_completion_tokens, finish)
        self.store(response)
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        body = response.model_dump()
        if metrics is not None:
            body["metrics"] = metrics
        out.append(self.sse(kind, response=body))
        return out

    def keepalive_event(self) -> str:
        return SSE_COMMENT_KEEPALIVE  # the Responses stream has no keep-alive event: an SSE comment

    def error_events(self, error: ApiError) -> list[str]:
        failure = {"code": error.info.code or error.info.type, "message": error.info.message}
        body = self.response_object("failed", [], None, error=failure).model_dump()
        return [self.sse("response.failed", response=body)]


def item_status(finish_reason: str | None) -> str:
    """An output message's status: cut at max_output_tokens is ``incomplete``, as the response is."""
    return "incomplete" if finish_reason == "length" else "completed"
