"""POST /v1/chat/completions: messages through the model's chat template, n choices, OpenAI's chat shapes."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.outputs import Logprob, RequestDelta
from tokenmill.server.async_engine import ChoiceResult, RequestGroup, collect
from tokenmill.server.common import (
    SSE_DONE,
    ApiError,
    ClientGone,
    ServerState,
    SSEResponse,
    check_model,
    context_length_error,
    failure_for,
    get_state,
    parse_body,
    read_json_body,
    request_body,
    sse,
    stream_failure,
    submit,
    until_disconnect,
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
    ParamError,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
    to_sampling_params,
)

router = APIRouter()


def encode_messages(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    """The prompt's token ids: the chat template applied to ``messages``; ParamError when it cannot be."""
    messages = req.template_messages()
    add_generation_prompt = True if req.add_generation_prompt is None else req.add_generation_prompt
    try:
        token_ids = state.async_engine.tokenizer.encode_chat(
            messages, add_generation_prompt=add_generation_prompt
        )
    except ValueError as exc:
        raise ParamError(str(exc), param="messages") from None
    if not token_ids:
        raise ParamError("messages produced an empty prompt", param="messages")
    return list(token_ids)


@router.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
async def create_chat_completion(request: Request) -> Response:
    state = get_state(request)
    req = parse_body(ChatCompletionRequest, await read_json_body(request, state.max_body_bytes))
    check_model(state, req.model)
    max_model_len = state.async_engine.max_model_len
    try:
        prompt_ids = await run_in_threadpool(encode_messages, state, req)  # the template off the event loop
        n = req.num_choices
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:  # OpenAI's default: whatever room the context leaves
            max_tokens = max(max_model_len - len(prompt_ids), 1)
        if max_tokens < 1:  # a prompt-only score is the completions route's echo
            param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            raise ParamError(f"{param} must be at least 1, got {max_tokens}", param=param)
        if max_tokens >= 1 and len(prompt_ids) + max_tokens > max_model_len:
            raise context_length_error(max_model_len, len(prompt_ids), max_tokens)
        top_logprobs = req.top_logprobs
        if top_logprobs and not req.logprobs:
            raise ParamError("top_logprobs requires logprobs to be true", param="top_logprobs")
        logprobs = (top_logprobs or 0) if req.logprobs else None
        engine_prompts = []
        for i in range(n):
            params = to_sampling_params(
                req,
                max_tokens=max_tokens,
                logprobs=logprobs,
                seed=None if req.seed is None else req.seed + i,
                chat=True,
            )
            engine_prompts.append((prompt_ids, params))
    except ParamError as exc:
        raise ApiError.from_param_error(exc) from None

    chat_id = f"chatcmpl-{uuid.uuid4().hex}"
    group: RequestGroup = await submit(
        state, engine_prompts, chat_id, req.cache_salt, structured_param=req.structured()[1]
    )
    view = _ChatView(state, req, chat_id, len(prompt_ids))
    if req.stream:
        return SSEResponse(_stream(view, group, state), on_disconnect=group.abort)
    try:
        results = await until_disconnect(request, collect(group), group.abort)
    except ClientGone:
        return Response(status_code=499)
    failure = failure_for(state.async_engine, group, results)
    if failure is not None:
        raise failure
    return JSONResponse(view.response(results).model_dump())


class _ChatView:
    """Turns engine deltas into OpenAI chat objects for one HTTP request."""

    def __init__(self, state: ServerState, req: ChatCompletionRequest, chat_id: str, num_prompt_tokens: int):
        self.tokenizer = state.async_engine.tokenizer
        self.model = state.served_model_name
        self.id = chat_id
        self.created = int(time.time())
        self.want_logprobs = bool(req.logprobs)
        self.include_usage = req.include_usage
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0

    def token_str(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

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
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)

    def usage(self, num_completion_tokens: int) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=num_completion_tokens,
            total_tokens=self.num_prompt_tokens + num_completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.num_cached_tokens),
        )

    def response(self, results: list[ChoiceResult]) -> ChatCompletionResponse:
        self.num_cached_tokens = max([self.num_cached_tokens, *(r.num_cached_tokens for r in results)])
        choices = [
            ChatChoice(
                index=index,
                message=ChatResponseMessage(content=result.text),
                logprobs=self.logprobs(result.token_ids, result.logprobs) if self.want_logprobs else None,
                finish_reason=result.finish_reason,
                stop_reason=result.stop_reason,
            )
            for index, result in enumerate(results)
        ]
        num_completion = sum(len(r.token_ids) for r in results)
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self.usage(num_completion),
        )

    def chunk(self, choice: ChatStreamChoice) -> str:
        chunk = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])
        return sse(chunk, exclude=None if self.include_usage else {"usage"})

    def role_chunk(self, index: int) -> str:
        return self.chunk(ChatStreamChoice(index=index, delta=ChatDelta(role="assistant", content="")))

    def delta_choice(self, index: int, delta: RequestDelta) -> ChatStreamChoice | None:
        logprobs = None
        if self.want_logprobs and delta.new_token_ids:
            logprobs = self.logprobs(delta.new_token_ids, delta.new_logprobs)
        if not delta.new_text and not delta.finished and logprobs is None:
            return None  # text held back (an incomplete character or a possible stop string)
        return ChatStreamChoice(
            index=index,
            delta=ChatDelta(content=delta.new_text),
            logprobs=logprobs,
            finish_reason=delta.finish_reason if delta.finished else None,
            stop_reason=delta.stop_reason if delta.finished else None,
        )

    def usage_chunk(self, num_completion_tokens: int) -> str:
        chunk = ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[],
            usage=self.usage(num_completion_tokens),
        )
        return sse(chunk)


async def _stream(view: _ChatView, group: RequestGroup, state: ServerState) -> AsyncIterator[str]:
    num_completion_tokens = 0
    try:
        for index in range(len(group.request_ids)):
            yield view.role_chunk(index)
        async for index, delta in group.stream():
            failure = stream_failure(state.async_engine, group, delta)
            if failure is not None:
                group.abort()
                yield failure.sse_event()
                break
            num_completion_tokens += len(delta.new_token_ids)
            view.saw(delta)
            choice = view.delta_choice(index, delta)
            if choice is not None:
                yield view.chunk(choice)
        else:
            if view.include_usage:
                yield view.usage_chunk(num_completion_tokens)
    except Exception as exc:  # a bug while formatting: tell the client, then end the stream properly
        group.abort()
        yield ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").sse_event()
    yield SSE_DONE
