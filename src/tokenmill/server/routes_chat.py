"""POST /v1/chat/completions: messages through the model's chat template, n choices, OpenAI's chat shapes."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from tokenmill.generation_defaults import default_max_tokens
from tokenmill.outputs import Logprob, RequestDelta
from tokenmill.reasoning import StreamSplit, prompt_opens_reasoning, split
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.server.async_engine import ChoiceResult, RequestGroup
from tokenmill.server.common import (
    ServerState,
    answering_model,
    api_error,
    check_text_chars,
    fit_max_tokens,
    parse_request,
    request_body,
    submit,
    tokenize_off_loop,
)
from tokenmill.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobEntry,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    FunctionCallOut,
    ParamError,
    ToolCallOut,
    TopLogprob,
    to_sampling_params,
)
from tokenmill.server.respond import OpenAIView, respond
from tokenmill.server.tool_calls import (
    HERMES_TAGS,
    fallback_system_prompt,
    forced_call_grammar,
    streamable_prefix,
)
from tokenmill.server.tool_calls import parse as parse_tool_calls

router = APIRouter()


# template variables a request sets through its own fields, never through chat_template_kwargs
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
)


def encode_messages(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    """The prompt's token ids: the chat template applied to ``messages``; ParamError when it cannot be."""
    messages = req.template_messages(state.tool_call_parser)
    add_generation_prompt = True if req.add_generation_prompt is None else req.add_generation_prompt
    tokenizer = state.async_engine.tokenizer
    tools = req.active_tools()
    template_tools = None
    if tools and getattr(tokenizer, "template_renders_tools", False):
        template_tools = tools
    elif tools:  # the template cannot show them: tokenmill's system message does (tool_calls.py)
        prompt = fallback_system_prompt(tools, state.tool_call_parser)
        if messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    num_chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
    check_text_chars(
        state, num_chars + (len(json.dumps(template_tools)) if template_tools else 0), "messages"
    )
    template_kwargs = {**state.default_chat_template_kwargs, **(req.chat_template_kwargs or {})}
    reserved = sorted(set(template_kwargs) & RESERVED_TEMPLATE_VARIABLES)
    if reserved:
        raise ParamError(
            f"chat_template_kwargs: {reserved[0]!r} is set by the request itself",
            param="chat_template_kwargs",
        )
    kwargs: dict[str, Any] = {} if template_tools is None else {"tools": template_tools}
    if template_kwargs:
        kwargs["template_kwargs"] = template_kwargs
    try:
        token_ids = tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    except ValueError as exc:
        raise ParamError(str(exc), param="messages") from None
    if not token_ids:
        raise ParamError("messages produced an empty prompt", param="messages")
    return list(token_ids)


@dataclass
class ChatPlan:
    """What a chat-shaped request becomes before it reaches the engine: the prompt's ids, one (ids, params) per
    choice, and the request field a constraint came from (named in the engine's refusal)."""

    prompt_ids: list[int]
    engine_prompts: list[tuple[list[int], SamplingParams]]
    structured_param: str | None


def plan_chat(state: ServerState, req: ChatCompletionRequest) -> ChatPlan:
    """The one place a chat request is turned into engine prompts: the template, max_tokens's default, the
    sampling fields, and the grammar of a forced tool call. The Responses and Messages APIs translate their
    requests into a ChatCompletionRequest and come here too. ParamError for what cannot be served. Runs the
    template: call it off the event loop."""
    prompt_ids = encode_messages(state, req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    defaults = state.async_engine.sampling_defaults
    if max_tokens is None:
        max_tokens = default_max_tokens(defaults, len(prompt_ids), state.async_engine.max_model_len)
    if max_tokens < 1:  # a prompt-only score is the completions route's echo
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        raise ParamError(f"{param} must be at least 1, got {max_tokens}", param=param)
    max_tokens = fit_max_tokens(state, len(prompt_ids), max_tokens)
    top_logprobs = req.top_logprobs
    if top_logprobs and not req.logprobs:
        raise ParamError("top_logprobs requires logprobs to be true", param="top_logprobs")
    logprobs = (top_logprobs or 0) if req.logprobs else None
    engine_prompts = []
    for i in range(req.num_choices):
        params = to_sampling_params(
            req,
            max_tokens=max_tokens,
            logprobs=logprobs,
            seed=None if req.seed is None else req.seed + i,
            chat=True,
            defaults=defaults,
        )
        engine_prompts.append((prompt_ids, params))
    if req.forces_tool_call:  # "required" or a named function: the grammar writes a valid call
        if req.structured()[1] is not None:
            raise ParamError("tool_choice forcing a call cannot be combined with an output constraint",
                             param="tool_choice")  # fmt: skip
        tokenizer = state.async_engine.tokenizer
        tags = {t: i for t in HERMES_TAGS if (i := tokenizer.added_token_id(t)) is not None}
        grammar = forced_call_grammar(
            req.active_tools(), state.tool_call_parser, req.parallel_tool_calls is True, tags
        )
        constraint = StructuredOutputsParams(grammar=grammar)
        engine_prompts = [(ids, replace(p, structured_outputs=constraint)) for ids, p in engine_prompts]
    structured_param = "tools" if req.forces_tool_call else req.structured()[1]
    if state.reasoning_parser is not None:  # the constraint applies to the answer, after the thought
        mode = thought_mode(state, prompt_ids)
        engine_prompts = [
            (ids, p if p.structured_outputs is None else
             replace(p, structured_outputs=replace(p.structured_outputs, after_think=mode)))
            for ids, p in engine_prompts
        ]  # fmt: skip
    return ChatPlan(prompt_ids, engine_prompts, structured_param)


def thought_mode(state: ServerState, prompt_ids: list[int]) -> str:
    """Whether an answer must come after a thought ("required": deepseek_r1's rule, or a prompt that opened
    ``<think>``) or may ("optional": qwen3's output opens its own thought, or none)."""
    tail = state.async_engine.tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
    if state.reasoning_parser == "deepseek_r1" or prompt_opens_reasoning(tail):
        return "required"
    return "optional"


@router.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
async def create_chat_completion(request: Request) -> Response:
    state, req = await parse_request(request, ChatCompletionRequest)
    try:
        plan = await tokenize_off_loop(plan_chat, state, req)  # the template off the event loop
    except ParamError as exc:
        raise api_error(exc) from None
    chat_id = f"chatcmpl-{uuid.uuid4().hex}"
    group: RequestGroup = await submit(
        state,
        plan.engine_prompts,
        chat_id,
        req.cache_salt,
        structured_param=plan.structured_param,
        model=req.model,
    )
    view = _ChatView(state, req, chat_id, len(plan.prompt_ids))
    view.model = answering_model(state, req.model)
    view.reasoning = reasoning_for(state, req, plan.prompt_ids)
    return await respond(request, state, view, group, bool(req.stream))


def reasoning_for(state: ServerState, req: ChatCompletionRequest, prompt_ids: list[int]) -> Reasoning | None:
    """How a reasoning model's answers are split (``--reasoning-parser``), or None when they are not."""
    if state.reasoning_parser is None:
        return None
    tail = state.async_engine.tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
    return Reasoning(state.reasoning_parser, prompt_opens_reasoning(tail), req.include_reasoning is not False)


@dataclass
class Reasoning:
    """A request's reasoning split: the parser, whether its prompt opened the thought, whether it is returned
    (``include_reasoning``); one :class:`StreamSplit` per streamed choice."""

    parser: str
    opened_in_prompt: bool
    included: bool
    streams: dict[int, StreamSplit] = field(default_factory=dict)

    def whole(self, text: str) -> tuple[str | None, str]:
        got = split(self.parser, text, self.opened_in_prompt)
        return (got.reasoning if self.included else None), got.content

    def piece(self, index: int, new_text: str, final: bool) -> tuple[str | None, str]:
        stream = self.streams.setdefault(index, StreamSplit(self.parser, self.opened_in_prompt))
        reasoning, content = stream.feed(new_text, final)
        return (reasoning if reasoning and self.included else None), content


class _ChatView(OpenAIView):
    """Turns engine deltas into OpenAI chat objects for one HTTP request."""

    chunk_class = ChatCompletionChunk

    def __init__(self, state: ServerState, req: ChatCompletionRequest, chat_id: str, num_prompt_tokens: int):
        super().__init__(state, chat_id, req.include_usage, num_prompt_tokens)
        self.want_logprobs = bool(req.logprobs)
        self.most_cached_tokens = 0
        self.parser = state.tool_call_parser
        self.tool_names = {t["function"]["name"] for t in req.active_tools()}
        self.buffers: dict[int, str] = {}  # with tools: each choice's text so far (calls are parsed whole)
        self.sent: dict[int, int] = {}  # ... and how much of it went out as content
        self.reasoning: Reasoning | None = None  # --reasoning-parser: the thinking split from the answer

    # --- respond.View ----------------------------------------------------------------------------------
    def opening_events(self, num_choices: int) -> list[str]:
        return [self.role_chunk(index) for index in range(num_choices)]

    def event(self, index: int, delta: RequestDelta) -> str | None:
        self.saw(delta)
        choice = self.delta_choice(index, delta)
        return None if choice is None else self.chunk(choice)

    def logprobs(self, token_ids: list[int], entries: list[Logprob] | None) -> ChatLogprobs:
        content = []
        for pos, token_id in enumerate(token_ids):
            entry = entries[pos] if entries and pos < len(entries) else None
            token = self.token_str(token_id)
            top = []
            if entry is not None:
                for tid, lp in entry.top_logprobs:
                    s = self.token_str(tid)
                    top.append(TopLogprob(token=s, logprob=lp, bytes=list(s.encode("utf-8"))))
            content.append(
                ChatLogprobEntry(
                    token=token,
                    logprob=entry.logprob if entry is not None else float("-inf"),
                    bytes=list(token.encode("utf-8")),
                    top_logprobs=top,
                )
            )
        return ChatLogprobs(content=content)

    def saw(self, delta: RequestDelta) -> None:
        """The prompt is counted once for all n choices; so are its cached tokens (the most any choice got)."""
        self.most_cached_tokens = max(self.most_cached_tokens, delta.num_cached_tokens)

    def num_cached_tokens(self) -> int:
        return self.most_cached_tokens

    def response(self, results: list[ChoiceResult]) -> ChatCompletionResponse:
        self.most_cached_tokens = max([self.most_cached_tokens, *(r.num_cached_tokens for r in results)])
        choices = []
        for index, result in enumerate(results):
            message, finish_reason = self.message(result.text, result.finish_reason)
            choices.append(
                ChatChoice(
                    index=index,
                    message=message,
                    logprobs=self.logprobs(result.token_ids, result.logprobs) if self.want_logprobs else None,
                    finish_reason=finish_reason,
                    stop_reason=result.stop_reason,
                )
            )
        return ChatCompletionResponse(
            choices=choices, **self.envelope(sum(len(r.token_ids) for r in results))
        )

    def message(
        self, text: str, finish_reason: str | None, split_reasoning: bool = True
    ) -> tuple[ChatResponseMessage, str | None]:
        """The answer, its reasoning split out (``--reasoning-parser``) and its tool calls parsed out of what
        follows it when tools were offered (finish_reason then "tool_calls")."""
        reasoning = None
        if self.reasoning is not None and split_reasoning:
            reasoning, text = self.reasoning.whole(text)
        thought = {"reasoning": reasoning, "reasoning_content": reasoning}
        if not self.tool_names:
            return ChatResponseMessage(content=text, **thought), finish_reason
        content, calls = parse_tool_calls(text, self.parser, self.tool_names)
        if not calls:
            return ChatResponseMessage(content=text, **thought), finish_reason
        out = [
            ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls
        ]
        return ChatResponseMessage(content=content, tool_calls=out, **thought), "tool_calls"

    def role_chunk(self, index: int) -> str:
        return self.chunk(ChatStreamChoice(index=index, delta=ChatDelta(role="assistant", content="")))

    def delta_choice(self, index: int, delta: RequestDelta) -> ChatStreamChoice | None:
        reasoning = None
        if self.reasoning is not None:  # the thinking goes out as delta.reasoning, the rest as below
            reasoning, text = self.reasoning.piece(index, delta.new_text, delta.finished)
            delta = replace(delta, new_text=text)
        if self.tool_names:
            choice = self._tool_delta_choice(index, delta)
            if reasoning is not None:
                choice = choice or ChatStreamChoice(index=index, delta=ChatDelta())
                choice.delta.reasoning = reasoning
            return choice
        logprobs = None
        if self.want_logprobs and delta.new_token_ids:
            logprobs = self.logprobs(delta.new_token_ids, delta.new_logprobs)
        if not delta.new_text and not delta.finished and logprobs is None and reasoning is None:
            return None  # text held back (an incomplete character or a possible stop string)
        return ChatStreamChoice(
            index=index,
            delta=ChatDelta(
                content=delta.new_text if delta.new_text or reasoning is None else None, reasoning=reasoning
            ),  # fmt: skip
            logprobs=logprobs,
            finish_reason=delta.finish_reason if delta.finished else None,
            stop_reason=delta.stop_reason if delta.finished else None,
        )

    def _tool_delta_choice(self, index: int, delta: RequestDelta) -> ChatStreamChoice | None:
        """With tools offered: text streams as it comes until it could be the start of a call (tool_calls.
        streamable_prefix); from there it is held, and at the end the calls go out as ``delta.tool_calls``."""
        text = self.buffers.get(index, "") + delta.new_text
        self.buffers[index] = text
        sent = self.sent.get(index, 0)
        if not delta.finished:
            ready = streamable_prefix(text, self.parser)
            if ready <= sent:
                return None
            self.sent[index] = ready
            return ChatStreamChoice(index=index, delta=ChatDelta(content=text[sent:ready]))
        del self.buffers[index]
        self.sent.pop(index, None)
        message, finish_reason = self.message(text, delta.finish_reason, split_reasoning=False)
        if not message.tool_calls:
            return ChatStreamChoice(
                index=index, delta=ChatDelta(content=text[sent:]), finish_reason=finish_reason,
                stop_reason=delta.stop_reason,
            )  # fmt: skip
        tool_calls = [
            {"index": i, "id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for i, c in enumerate(message.tool_calls)
        ]  # fmt: skip
        return ChatStreamChoice(
            index=index, delta=ChatDelta(tool_calls=tool_calls), finish_reason=finish_reason,
            stop_reason=delta.stop_reason,
        )  # fmt: skip
