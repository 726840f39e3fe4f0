"""What every route shares: OpenAI-shaped errors, a bounded body reader, the SSE response that aborts on
disconnect, and the non-streaming wait that does the same."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from tokenmill import errors
from tokenmill.outputs import RequestDelta
from tokenmill.server.async_engine import AsyncEngine, ChoiceResult, RequestGroup
from tokenmill.server.protocol import ErrorInfo, ErrorResponse, ParamError, validation_error_to_param
from tokenmill.server.response_store import ResponseStore

logger = logging.getLogger("tokenmill.server")

RETRY_AFTER_S = 1
ModelT = TypeVar("ModelT", bound=BaseModel)
T = TypeVar("T")


KEY_OWNER = "tokenmill_key_owner"  # in the ASGI scope's state: who stores what this request stores


def key_owner(request: HTTPConnection) -> str:
    """The owner of what this request stores (a digest of its API key; ``""`` when the server has none)."""
    return str(request.scope.get("state", {}).get(KEY_OWNER, ""))


@dataclass
class ServerState:
    async_engine: AsyncEngine
    served_model_name: str
    api_keys: tuple[str, ...]
    max_body_bytes: int
    body_timeout_s: float = 30.0
    tool_call_parser: str = "hermes"
    response_store: ResponseStore = field(default_factory=ResponseStore)  # the Responses API's store: true
    enable_per_request_metrics: bool = False  # a `metrics` object with each response (RequestMetrics.as_json)
    model_aliases: frozenset[str] = (
        frozenset()
    )  # other names requests may use: the pulled name, the file's own
    # a max_tokens past the context's end: "cap" (generate to the end, finish_reason "length", as llama.cpp's
    # and Ollama's servers do) or "refuse" (400, as OpenAI's API and vLLM do)
    max_tokens_past_context: str = "cap"
    reasoning_parser: str | None = None  # deepseek_r1 | qwen3: a thinking model's <think> text split out
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # under each request's own
    # LoRA adapters served by name (a request's `model`), and whether /v1/load_lora_adapter may change them
    lora_modules: dict[str, Any] = field(default_factory=dict)
    allow_runtime_lora_updating: bool = False


def fit_max_tokens(state: ServerState, num_prompt_tokens: int, max_tokens: int) -> int:
    """``max_tokens`` for a prompt of ``num_prompt_tokens``: under "cap", at most what the context has left
    after the prompt (a prompt that fills the context is left to the engine's refusal)."""
    room = state.async_engine.max_model_len - num_prompt_tokens
    if state.max_tokens_past_context == "cap" and 0 < room < max_tokens:
        return room
    return max_tokens


MAX_CHARS_PER_TOKEN = 32  # text past this many characters per token of context could never be a prompt


def check_text_chars(state: ServerState, num_chars: int, param: str) -> None:
    """ParamError for text too long to be any prompt of this model, before a tokenizer spends seconds on it
    (tokenizing is linear: this bounds its time, and what a request holds of the server)."""
    limit = MAX_CHARS_PER_TOKEN * state.async_engine.max_model_len
    if num_chars > limit:
        raise ParamError(
            f"{param}: {num_chars} characters of text cannot fit this model's context of "
            f"{state.async_engine.max_model_len} tokens (the server tokenizes at most {limit} characters, "
            f"{MAX_CHARS_PER_TOKEN} per token of context)",
            param=param,
        )


TEXT_BUDGET_S = 10.0  # a request's template and tokenization; the size bound above keeps real ones to ~2 s


async def tokenize_off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` (a template, a tokenization) on a worker thread, never the event loop or the engine's,
    within ``TEXT_BUDGET_S``: past it the request gets a 400 and the work is abandoned, not waited for."""
    try:
        return await asyncio.wait_for(run_in_threadpool(fn, *args), TEXT_BUDGET_S)
    except TimeoutError:
        raise ApiError.bad_request(
            f"preparing the prompt (template and tokenizer) ran over the {TEXT_BUDGET_S:g} s limit"
        ) from None


def get_state(request: HTTPConnection) -> ServerState:
    state: ServerState = request.app.state.tokenmill
    return state


class ApiError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers
        self.anthropic_message: str | None = None  # where Anthropic's API words it otherwise

    @classmethod
    def bad_request(cls, message: str, param: str | None = None, code: str | None = None) -> ApiError:
        return cls(400, message, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(
            ErrorResponse(error=self.info).model_dump(), status_code=self.status_code, headers=self.headers
        )

    def sse_event(self) -> str:
        return f"data: {ErrorResponse(error=self.info).model_dump_json()}\n\n"

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}``, typed by status."""
        kind = ANTHROPIC_ERROR_TYPES.get(
            self.status_code, "api_error" if self.status_code >= 500 else "invalid_request_error"
        )
        return {
            "type": "error",
            "error": {"type": kind, "message": self.anthropic_message or self.info.message},
        }

    def response_for(self, path: str) -> JSONResponse:
        """The error in the shape the API at ``path`` speaks: Anthropic's under /v1/messages, else OpenAI's.

        Logged, one line (the access log says only "400 Bad Request": an operator needs the field a client sent
        that was refused)."""
        logger.log(
            logging.WARNING if self.status_code >= 500 else logging.INFO,
            "%s -> %d%s: %s",
            path,
            self.status_code,
            f" ({self.info.param})" if self.info.param else "",
            self.info.message,
        )
        if not is_anthropic_path(path):
            return self.response()
        return JSONResponse(self.anthropic_body(), status_code=self.status_code, headers=self.headers)


ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
    503: "overloaded_error", 529: "overloaded_error",
}  # fmt: skip


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def queue_full(message: str) -> ApiError:
    return ApiError(
        429, message, type="rate_limit_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}
    )


def unavailable(message: str) -> ApiError:
    return ApiError(
        503, message, type="server_error", code="unavailable", headers={"Retry-After": str(RETRY_AFTER_S)}
    )


def context_length_error(max_model_len: int, num_prompt_tokens: int, num_completion_tokens: int) -> ApiError:
    """In OpenAI's words, and in Anthropic's for the Messages API: Claude Code reads the numbers of "input
    length and `max_tokens` exceed context limit" to resend with a max_tokens that fits, and "prompt is too
    long" to compact its conversation."""
    requested = num_prompt_tokens + num_completion_tokens
    error = ApiError.bad_request(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{requested} tokens ({num_prompt_tokens} in the messages, {num_completion_tokens} in the completion). "
        "Please reduce the length of the messages or completion.",
        param="messages",
        code="context_length_exceeded",
    )
    if num_prompt_tokens >= max_model_len:
        error.anthropic_message = f"prompt is too long: {num_prompt_tokens} tokens > {max_model_len} maximum"
    else:
        error.anthropic_message = (
            f"input length and `max_tokens` exceed context limit: {num_prompt_tokens} + {num_completion_tokens} "
            f"> {max_model_len}, decrease input length or `max_tokens` and try again"
        )
    return error


async def read_json_body(request: Request, max_body_bytes: int, timeout_s: float | None = None) -> Any:
    """The request's JSON body; 413 past ``max_body_bytes`` (checked as bytes arrive), 408 when it has not
    all arrived within ``timeout_s`` (the app's body timeout by default), 400 if not JSON."""
    if timeout_s is None:
        timeout_s = get_state(request).body_timeout_s
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise _too_large(max_body_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_body_bytes:
                    raise _too_large(max_body_bytes)
                chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError.bad_request("the client disconnected while sending the body") from None
    except TimeoutError:
        raise ApiError(
            408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout",
            headers={"Connection": "close"},
        ) from None  # fmt: skip
    return await run_in_threadpool(parse_json, b"".join(chunks))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


MAX_JSON_DEPTH = 64  # nesting deeper than any OpenAI request needs (tool schemas included)


def parse_json(raw: bytes) -> Any:
    """Strict JSON: a 400 for anything malformed, at any depth or size (never a RecursionError's 500), and for
    text that is not valid Unicode (a lone surrogate such as ``"\\ud800"``, which JSON's escapes can spell
    and no encoder downstream can write), naming the field that holds it."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError.bad_request("the body is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, bad UTF-8, NaN/Infinity, integers past Python's digit limit
        raise ApiError.bad_request(f"the body is not valid JSON: {exc}") from None
    check_json_value(body, MAX_JSON_DEPTH)
    return body


def check_json_value(value: Any, max_depth: int, at: str = "") -> None:
    """A 400 when ``value`` (parsed JSON) nests more than ``max_depth`` levels or holds a string (a key or a
    value) that is not valid Unicode. Iterative: no recursion limit to hit."""
    stack: list[tuple[Any, str, int]] = [(value, at, 1)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item, path)
            continue
        if not isinstance(item, dict | list):
            continue
        if depth > max_depth:
            raise ApiError.bad_request(f"the body is nested more than {max_depth} levels deep")
        if isinstance(item, dict):
            for key, child in item.items():
                child_path = f"{path}.{key}" if path else str(key)
                _check_text(key, child_path)
                stack.append((child, child_path, depth + 1))
        else:
            stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(item))


def _check_text(text: str, path: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        field = path.encode("utf-8", "backslashreplace").decode() or None
        raise ApiError.bad_request(
            f"{field or 'the body'}: the text is not valid Unicode (a lone surrogate "
            f"{text[exc.start]!r} at character {exc.start})",
            param=field,
        ) from None


def _too_large(max_body_bytes: int) -> ApiError:
    return ApiError(
        413, f"the request body exceeds {max_body_bytes} bytes", param=None, code="request_too_large"
    )


def parse_body(model: type[ModelT], body: Any) -> ModelT:
    if not isinstance(body, dict):
        raise ApiError.bad_request("the body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise api_error(validation_error_to_param(exc)) from None


# Request models by name, for /openapi.json: the routes parse their own JSON (for OpenAI-shaped errors and
# the bounded reader), so FastAPI cannot see their bodies; request_body() names them.
BODY_MODELS: dict[str, type[BaseModel]] = {}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route that parses its own JSON body: the pydantic model as its request body."""
    BODY_MODELS[model.__name__] = model
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def answering_model(state: ServerState, model: str | None) -> str:
    """The `model` a response names: the LoRA adapter's name when the request asked for one, else the served
    model's (an alias asked for is answered with the served name)."""
    return model if model is not None and model in state.lora_modules else state.served_model_name


def check_model(state: ServerState, model: str | None) -> None:
    if model is None or model == state.served_model_name or model in state.model_aliases:
        return
    if model not in state.lora_modules:
        raise ApiError(
            404, f"The model `{model}` does not exist.", type="invalid_request_error", param="model",
            code="model_not_found",
        )  # fmt: skip


async def parse_request(
    request: Request, model: type[ModelT], task: str | None = "generate"
) -> tuple[ServerState, ModelT]:
    """The server's state and the request's body as ``model``: 413 / 408 / 400 from the body reader and the
    model, 404 for a model this server does not serve, 400 for a route of another ``task`` than the model's
    ("generate" or "embed"; None: any)."""
    state = get_state(request)
    req = parse_body(model, await read_json_body(request, state.max_body_bytes))
    check_model(state, getattr(req, "model", None))
    check_task(state, task)
    return state, req


def check_task(state: ServerState, task: str | None) -> None:
    is_pooling = state.async_engine.is_pooling
    if task == "generate" and is_pooling:
        raise ApiError.bad_request(
            f"{state.served_model_name} is an embedding model: it serves /v1/embeddings, not generation",
            param="model", code="wrong_model_type",
        )  # fmt: skip
    if task == "embed" and not is_pooling:
        raise ApiError.bad_request(
            f"{state.served_model_name} is not an embedding model: /v1/embeddings needs one "
            "(tokenmill serve --model all-minilm-l6-v2)",
            param="model", code="wrong_model_type",
        )  # fmt: skip


async def submit(
    state: ServerState,
    prompts: list[tuple[list[int], Any]],
    request_id: str,
    cache_salt: str | None = None,
    structured_param: str | None = None,
    model: str | None = None,
) -> Any:
    """AsyncEngine.submit with its refusals mapped to HTTP by :func:`api_error`. ``structured_param``: the
    request field that gave the constraint (``response_format``, ``tools``...), named instead of the engine's
    ``structured_outputs``. ``model``: the request's; a LoRA adapter's name runs the prompts with it."""
    lora = state.lora_modules.get(model) if model is not None else None
    try:
        return await state.async_engine.submit(
            prompts, request_id=request_id, cache_salt=cache_salt, lora_request=lora
        )
    except errors.BadRequestError as exc:
        if exc.param == "structured_outputs" and structured_param is not None:
            raise ApiError.bad_request(
                exc.message.replace("structured_outputs", structured_param, 1), param=structured_param
            ) from None
        raise api_error(exc) from None
    except errors.TokenmillError as exc:
        raise api_error(exc) from None


def api_error(exc: errors.TokenmillError) -> ApiError:
    """The one mapping of tokenmill's errors (``tokenmill.errors``) to OpenAI's shapes: a bad request 400 with
    its param (a context too short in OpenAI's words), not found 404, a full queue 429 with Retry-After (the
    only 429), unavailable 503."""
    if isinstance(exc, errors.ContextLengthError):
        return context_length_error(exc.max_model_len, exc.num_prompt_tokens, exc.num_completion_tokens)
    if isinstance(exc, errors.BadRequestError):
        return ApiError(400, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, errors.NotFoundError):
        return ApiError(404, exc.message, param=exc.param, code=exc.code or "not_found")
    if isinstance(exc, errors.QueueFullError):
        return queue_full(str(exc))
    if isinstance(exc, errors.UnavailableError):
        return unavailable(str(exc))
    return ApiError(500, f"internal error: {exc}", type="server_error", code="internal_error")


def stream_failure(async_engine: AsyncEngine, group: RequestGroup, delta: RequestDelta) -> ApiError | None:
    """The error a terminal delta stands for, or None when it ended normally (or the client left).

    ``finish_reason="error"`` is mapped by its kind (``tokenmill.errors``): under load (preempted too often)
    503 ``overloaded`` with Retry-After (429 means only a full queue); a failed step or a failure inside the
    constraint machinery 500 (the server's fault: the next request may well succeed); the whole loop dead 503. An ``"abort"`` the client did not
    ask for is the server shutting down: 503.
    """
    if not delta.finished:
        return None
    if delta.finish_reason == "error":
        if not async_engine.alive:
            return unavailable(delta.error or "the engine loop has died")
        message = delta.error or "the engine ended the request"
        if delta.error_kind == errors.OVERLOADED:  # not the queue: the pool is too small for the load
            return ApiError(503, message, type="server_error", code="overloaded",
                            headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
        if delta.error_kind in (errors.STEP_FAILED, errors.CONSTRAINT_FAILED):
            return ApiError(500, message, type="server_error", code=delta.error_kind)
        return ApiError(500, message, type="server_error", code="internal_error")
    if delta.finish_reason == "abort" and not group.aborted_by_client:
        return unavailable("the server is shutting down; the request was aborted")
    return None


def failure_for(
    async_engine: AsyncEngine, group: RequestGroup, results: list[ChoiceResult]
) -> ApiError | None:
    for result in results:
        delta = RequestDelta(
            request_id="", new_token_ids=[], new_text="", finished=True, finish_reason=result.finish_reason,
            error=result.error, error_kind=result.error_kind,
        )  # fmt: skip
        failure = stream_failure(async_engine, group, delta)
        if failure is not None:
            return failure
    return None


def sse(payload: BaseModel | dict[str, Any], exclude: set[str] | None = None) -> str:
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json(exclude=exclude)
    else:
        body = json.dumps(payload)
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class SSEResponse(Response):
    """Server-sent events from an async iterator of ready ``data: ...\\n\\n`` strings.

    Unlike Starlette's StreamingResponse it always listens for ``http.disconnect`` while streaming, and on
    a disconnect (or a failed send) calls ``on_disconnect`` at once, before the generator is closed: the
    engine hears about the abort within one step whatever ASGI version the server speaks.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_disconnect: Callable[[], None]) -> None:
        # Not Response.__init__: it would render an empty body and announce Content-Length: 0.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events
        self.on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        pump_task = asyncio.ensure_future(pump())
        watch_task = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({pump_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
            if pump_task.done() and pump_task.exception() is None:
                return
            self.on_disconnect()  # the client went away (or a send failed): abort before anything else
        except asyncio.CancelledError:  # the server is cancelling us (forced shutdown)
            self.on_disconnect()
            raise
        finally:
            for task in (pump_task, watch_task):
                task.cancel()
            for task in (pump_task, watch_task):
                with contextlib.suppress(BaseException):
                    await task
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(BaseException):
                    await aclose()


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    """The client disconnected before its non-streaming answer was ready."""


T = TypeVar("T")


async def until_disconnect(request: Request, work: Awaitable[T], on_disconnect: Callable[[], None]) -> T:
    """Await ``work`` unless the client disconnects first: then call ``on_disconnect`` and raise ClientGone."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        on_disconnect()
        work_task.cancel()
        watch_task.cancel()
        raise
    if work_task.done():
        watch_task.cancel()
        with contextlib.suppress(BaseException):
            await watch_task
        return work_task.result()
    on_disconnect()
    work_task.cancel()
    with contextlib.suppress(BaseException):
        await work_task
    raise ClientGone()
