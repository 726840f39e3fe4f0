"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

A request becomes a chat request (``protocol_messages``) and goes through ``routes_chat.plan_chat``, like every
other API. The answer is a ``message`` with ``text`` and ``tool_use`` content blocks, or Anthropic's event
stream (``message_start``, ``content_block_start``/``_delta``/``_stop``, ``message_delta``, ``message_stop``).
Errors on these paths are in Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``, written by
``common.ApiError.anthropic_response``), and ``x-api-key`` is taken as well as a bearer token.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.outputs import RequestDelta
from tokenmill.server.async_engine import ChoiceResult
from tokenmill.server.common import (
    ApiError,
    ServerState,
    answering_model,
    api_error,
    parse_request,
    request_body,
    submit,
    tokenize_off_loop,
)
from tokenmill.server.protocol import ParamError
from tokenmill.server.protocol_messages import CountTokensRequest, MessageObject, MessagesRequest, Usage
from tokenmill.server.respond import respond
from tokenmill.server.routes_chat import Reasoning, encode_messages, plan_chat, reasoning_for
from tokenmill.server.tool_calls import parse as parse_tool_calls
from tokenmill.server.tool_calls import streamable_prefix

router = APIRouter()

_PARAM_NAMES = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}


def _renamed(exc: ParamError) -> ApiError:
    param = _PARAM_NAMES.get(exc.param or "", exc.param)
    message = exc.message if param == exc.param else exc.message.replace(exc.param or "", param or "", 1)
    return api_error(ParamError(message, param=param, code=exc.code))


@router.post("/v1/messages", openapi_extra=request_body(MessagesRequest))
async def create_message(request: Request) -> Response:
    state, req = await parse_request(request, MessagesRequest)
    try:
        chat = req.to_chat()
        plan = await tokenize_off_loop(plan_chat, state, chat)
    except ParamError as exc:
        raise _renamed(exc) from None
    message_id = f"msg_{uuid.uuid4().hex}"
    group = await submit(state, plan.engine_prompts, message_id, structured_param="tools", model=req.model)
    view = _MessagesView(state, req, message_id, len(plan.prompt_ids))
    view.reasoning = reasoning_for(state, chat, plan.prompt_ids)
    view.show_thinking = req.thinking is None or req.thinking.display != "omitted"
    return await respond(request, state, view, group, bool(req.stream))


@router.post("/v1/messages/count_tokens", openapi_extra=request_body(CountTokensRequest))
async def count_tokens(request: Request) -> Response:
    state, req = await parse_request(request, CountTokensRequest)
    try:
        ids = await tokenize_off_loop(encode_messages, state, req.to_chat())
    except ParamError as exc:
        raise _renamed(exc) from None
    return JSONResponse({"input_tokens": len(ids)})


class _MessagesView:
    """One request's message, whole or as Anthropic's event stream (one choice)."""

    def __init__(self, state: ServerState, req: MessagesRequest, message_id: str, num_prompt_tokens: int):
        self.state = state
        self.id = message_id
        self.model = answering_model(state, req.model)
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        choice = req.tool_choice
        offered = {t.name for t in req.function_tools()}
        self.tool_names = set() if choice is not None and choice.type == "none" else offered
        self.single_call = bool(choice is not None and choice.disable_parallel_tool_use)
        self.parser = state.tool_call_parser
        # streaming state
        self.started = False
        self.text = ""
        self.sent = 0
        self.text_open = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # --reasoning-parser: the thinking as a thinking block before the answer (index 0); its text left out
        # with thinking.display "omitted", as Anthropic's API does
        self.reasoning: Reasoning | None = None
        self.show_thinking = True
        self.thinking_open = False
        self.thinking_done = False

    @property
    def text_index(self) -> int:
        return 1 if self.thinking_open else 0

    def thinking_block(self, text: str) -> dict[str, Any]:
        # no signature: nothing here verifies a thought sent back (they are dropped from the prompt)
        return {"type": "thinking", "thinking": text if self.show_thinking else "", "signature": ""}

    def thinking_delta(self, piece: str) -> str:
        out = ""
        if not self.thinking_open:
            self.thinking_open = True
            out += self.sse("content_block_start", index=0, content_block=self.thinking_block(""))
        if self.show_thinking:
            out += self.sse(
                "content_block_delta", index=0, delta={"type": "thinking_delta", "thinking": piece}
            )
        return out

    def close_thinking(self) -> str:
        if not self.thinking_open or self.thinking_done:
            return ""
        self.thinking_done = True
        return self.sse(
            "content_block_delta", index=0, delta={"type": "signature_delta", "signature": ""}
        ) + (self.sse("content_block_stop", index=0))

    def usage(self, num_output_tokens: int) -> Usage:
        return Usage(
            input_tokens=self.num_prompt_tokens - self.num_cached_tokens, output_tokens=num_output_tokens,
            cache_read_input_tokens=self.num_cached_tokens,
        )  # fmt: skip

    def split(self, text: str) -> tuple[str, list[Any]]:
        if not self.tool_names:
            return text, []
        content, calls = parse_tool_calls(text, self.parser, self.tool_names)
        if self.single_call:
            calls = calls[:1]
        return ((content or "") if calls else text), calls

    @staticmethod
    def tool_block(call: Any) -> dict[str, Any]:
        return {"type": "tool_use", "id": f"toolu_{call.id.removeprefix('call_')}", "name": call.name,
                "input": json.loads(call.arguments)}  # fmt: skip

    def stop(
        self, finish_reason: str | None, stop_reason: int | str | None, calls: list[Any]
    ) -> tuple[str, str | None]:
        """Anthropic's stop_reason (and the stop sequence that matched)."""
        if calls:
            return "tool_use", None
        if finish_reason == "length":
            return "max_tokens", None
        if isinstance(stop_reason, str):
            return "stop_sequence", stop_reason
        return "end_turn", None

    # --- respond.View: whole -------------------------------------------------------------------------------
    def response(self, results: list[ChoiceResult]) -> MessageObject:
        (result,) = results
        self.num_cached_tokens = result.num_cached_tokens
        text, thinking = result.text, []
        if self.reasoning is not None:
            thought, text = self.reasoning.whole(text)
            thinking = [self.thinking_block(thought)] if thought is not None else []
        content, calls = self.split(text)
        blocks = (
            thinking
            + ([{"type": "text", "text": content}] if content or not calls else [])
            + [self.tool_block(c) for c in calls]
        )
        stop_reason, stop_sequence = self.stop(result.finish_reason, result.stop_reason, calls)
        return MessageObject(
            id=self.id, model=self.model, content=blocks, stop_reason=stop_reason,  # type: ignore[arg-type]
            stop_sequence=stop_sequence, usage=self.usage(len(result.token_ids)),
        )  # fmt: skip

    # --- respond.View: streamed ----------------------------------------------------------------------------
    @staticmethod
    def sse(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    def opening_events(self, num_choices: int) -> list[str]:
        # message_start at once, before the prefill: its usage counts the whole prompt as input (what the prefix
        # cache served is not known yet); message_delta's usage at the end has the final counts, cache reads too
        return [self.start()]

    def keepalive_event(self) -> str:
        return self.sse("ping")

    def start(self) -> str:
        if self.started:
            return ""
        self.started = True
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": self.usage(0).model_dump()}  # fmt: skip
        return self.sse("message_start", message=message) + self.sse("ping")

    def text_delta(self, piece: str) -> str:
        out = self.close_thinking()  # the answer follows the thinking
        at = self.text_index
        if not self.text_open:
            self.text_open = True
            out += self.sse("content_block_start", index=at, content_block={"type": "text", "text": ""})
        if piece:
            out += self.sse("content_block_delta", index=at, delta={"type": "text_delta", "text": piece})
        return out

    def event(self, index: int, delta: RequestDelta) -> str | None:
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        out = self.start()
        new_text = delta.new_text
        if self.reasoning is not None:  # the thinking streams as a thinking block, the rest as below
            thought, new_text = self.reasoning.piece(0, new_text, delta.finished)
            out += self.thinking_delta(thought) if thought else ""
        self.text += new_text
        if delta.finished:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        ready = len(self.text) if not self.tool_names else streamable_prefix(self.text, self.parser)
        if ready > self.sent:
            out += self.text_delta(self.text[self.sent : ready])
            self.sent = ready
        return out or None

    def closing_events(self, num_completion_tokens: int, metrics: Any = None) -> list[str]:
        out = [self.start(), self.close_thinking()]
        content, calls = self.split(self.text)
        if not calls and (len(self.text) > self.sent or not self.text_open):
            out.append(self.text_delta(self.text[self.sent :]))
            self.sent = len(self.text)
        index = self.text_index
        if self.text_open:
            out.append(self.sse("content_block_stop", index=index))
            index += 1
        for call in calls:
            block = self.tool_block(call)
            out.append(self.sse("content_block_start", index=index, content_block={**block, "input": {}}))
            out.append(self.sse("content_block_delta", index=index,
                                delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])}))  # fmt: skip
            out.append(self.sse("content_block_stop", index=index))
            index += 1
        stop_reason, stop_sequence = self.stop(self.finish_reason, self.stop_reason, calls)
        usage = self.usage(num_completion_tokens).model_dump()
        extra = {} if metrics is None else {"metrics": metrics}
        out.append(self.sse("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                            usage=usage, **extra))  # fmt: skip
        out.append(self.sse("message_stop"))
        return [event for event in out if event]

    def error_events(self, error: ApiError) -> list[str]:
        body = error.anthropic_body()
        return [f"event: error\ndata: {json.dumps(body)}\n\n"]
