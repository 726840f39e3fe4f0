"""The FastAPI app: ``build_app(async_engine, ...)`` wires routes, the API-key gate and the errors (OpenAI's
shape; Anthropic's under /v1/messages).

Routes (``routes_*.py``): POST /v1/completions and /v1/chat/completions; OpenAI's Responses API (POST
/v1/responses, GET and DELETE /v1/responses/{id}: ``routes_responses``); Anthropic's POST /v1/messages and
/v1/messages/count_tokens (``routes_messages``); POST /v1/embeddings for an embedding model
(``routes_embeddings``); GET /v1/models, /v1/models/{id}, /health, /metrics, /version (``routes_info``); vLLM's
POST /tokenize and /detokenize and GET /tokenizer_info (``routes_tokenize``). CORS only when configured
(``--allowed-origins``). ``/openapi.json`` carries each POST's request model. With an API key every route needs
``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key``) except the allow-list (/health, /metrics): the
check is an ASGI middleware in front of the router, so a route added later is covered without anyone
remembering to.
Handlers never touch the Engine: they go through :class:`~tokenmill.server.async_engine.AsyncEngine`.
Prompts are never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.server.async_engine import AsyncEngine
from tokenmill.server.common import (
    BODY_MODELS,
    KEY_OWNER,
    ApiError,
    ServerState,
)
from tokenmill.server.observers import current_trace_headers
from tokenmill.server.response_store import ResponseStore

OPEN_PATHS = frozenset(
    {"/health", "/metrics", "/"}
)  # "/": the chat page (it holds no data; it asks for the key)
DEFAULT_MAX_BODY_BYTES = 8 << 20


def build_app(
    async_engine: AsyncEngine,
    served_model_name: str | None = None,
    api_key: str | Sequence[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    *,
    body_timeout_s: float = 30.0,
    cors: dict[str, Any] | None = None,
    max_header_bytes: int | None = None,
    tool_call_parser: str = "hermes",
    response_store: ResponseStore | None = None,
    enable_per_request_metrics: bool = False,
    model_aliases: Sequence[str] = (),
    max_tokens_past_context: str = "cap",
    reasoning_parser: str | None = None,
    default_chat_template_kwargs: dict[str, Any] | None = None,
    ui: bool = True,
    lora_modules: dict[str, Any] | None = None,
) -> FastAPI:
    """The app. Its lifespan starts the engine thread and, at shutdown, stops it (aborting what is left).

    ``api_key``: one key or several (each stored response is readable only with the key that created it).
    ``cors``: keyword arguments of Starlette's CORSMiddleware (``allow_origins`` ...), or None for no CORS.
    ``lora_modules``: LoRA adapters served by name (``LoRARequest`` by ``lora_name``; loaded in the engine already).
    """
    from tokenmill.server import routes_lora

    state = ServerState(
        async_engine=async_engine,
        served_model_name=served_model_name or async_engine.model_name,
        api_keys=tuple(k for k in ([api_key] if isinstance(api_key, str) else api_key or ()) if k),
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
        tool_call_parser=tool_call_parser,
        response_store=ResponseStore() if response_store is None else response_store,
        enable_per_request_metrics=enable_per_request_metrics,
        model_aliases=frozenset(model_aliases),
        max_tokens_past_context=max_tokens_past_context,
        reasoning_parser=reasoning_parser,
        default_chat_template_kwargs=dict(default_chat_template_kwargs or {}),
        lora_modules=dict(lora_modules or {}),
        allow_runtime_lora_updating=routes_lora.runtime_updating_allowed(),
    )

    if getattr(async_engine, "metrics", None) is not None:
        async_engine.metrics.watch_response_store(state.response_store)
        async_engine.metrics.watch_constraints(async_engine.constraint_compiler)

    app = FastAPI(title="tokenmill", lifespan=_lifespan(async_engine))
    app.state.tokenmill = state
    _include_routes(app, runtime_lora=state.allow_runtime_lora_updating, ui=ui)
    _add_error_handlers(app)
    _add_middleware(app, state.api_keys, max_header_bytes, cors)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _lifespan(async_engine: AsyncEngine) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The engine thread runs while the app does; at shutdown it stops (aborting what is left)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        await run_in_threadpool(async_engine.stop)

    return lifespan


def _include_routes(app: FastAPI, *, runtime_lora: bool, ui: bool) -> None:
    """Every API's routes; adapter loading only where runtime updating is allowed, the chat page unless off."""
    from tokenmill.server import (
        routes_chat,
        routes_completions,
        routes_embeddings,
        routes_info,
        routes_lora,
        routes_messages,
        routes_ollama,
        routes_responses,
        routes_responses_socket,
        routes_tokenize,
    )

    for module in (
        routes_completions, routes_chat, routes_responses, routes_responses_socket, routes_messages,
        routes_embeddings, routes_info, routes_tokenize, routes_ollama,
    ):  # fmt: skip
        app.include_router(module.router)
    if runtime_lora:
        app.include_router(routes_lora.router)
    if ui:
        app.include_router(routes_info.ui_router)


def _add_middleware(
    app: FastAPI, api_keys: tuple[str, ...], max_header_bytes: int | None, cors: dict[str, Any] | None
) -> None:
    """Innermost first: trace context, the API key check, the header bound, CORS outermost (a preflight carries
    no API key, and every answer needs the CORS headers)."""
    app.add_middleware(TraceContextMiddleware)
    if api_keys:
        app.add_middleware(ApiKeyMiddleware, api_keys=api_keys, open_paths=OPEN_PATHS)
    if max_header_bytes is not None:
        app.add_middleware(HeaderLimitMiddleware, max_header_bytes=max_header_bytes)
    if cors is not None:
        app.add_middleware(CORSMiddleware, **cors)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, plus the request models the routes name with :func:`request_body`."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    _, defs = models_json_schema(
        [(m, "validation") for m in BODY_MODELS.values()], ref_template="#/components/schemas/{model}"
    )
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    app.openapi_schema = schema
    return schema


class TraceContextMiddleware:
    """Keeps the request's W3C trace-context headers (``traceparent``, ``tracestate``) where
    ``AsyncEngine.submit`` finds them (``observers.current_trace_headers``), for the tracer's spans."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope.get("headers", ())
            if name in (b"traceparent", b"tracestate")
        }
        token = current_trace_headers.set(headers or None)
        try:
            await self.app(scope, receive, send)
        finally:
            current_trace_headers.reset(token)


class HeaderLimitMiddleware:
    """431 for a request whose headers (names and values) add up to more than ``max_header_bytes``.

    h11 bounds headers that arrive in pieces (``http_protocol``); a block that arrives whole is checked here.
    """

    def __init__(self, app: ASGIApp, max_header_bytes: int) -> None:
        self.app = app
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = sum(len(name) + len(value) for name, value in scope.get("headers", ()))
            if size > self.max_header_bytes:
                error = ApiError(
                    431, f"the request headers exceed {self.max_header_bytes} bytes", code="headers_too_large"
                )
                await error.response_for(scope.get("path", ""))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ApiKeyMiddleware:
    """Rejects, with 401, every HTTP request but those to ``open_paths`` that lacks one of the keys: a bearer
    token (OpenAI's clients) or an ``x-api-key`` header (Anthropic's); a WebSocket without one is closed before
    its handshake completes (403). An accepted request carries its key's
    owner id (a digest, never the key) in the scope's state (``common.KEY_OWNER``): what it stores is its own.

    The comparison is constant-time over SHA-256 digests against every key (no early exit), so neither
    content, length nor which key matched leaks by timing.
    """

    def __init__(
        self, app: ASGIApp, api_keys: Sequence[str], open_paths: frozenset[str] = OPEN_PATHS
    ) -> None:
        self.app = app
        self._digests = [hashlib.sha256(key.encode()).digest() for key in api_keys]
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path") in self.open_paths:
            await self.app(scope, receive, send)
            return
        owner = self._owner(scope)
        if owner is not None:
            scope.setdefault("state", {})[KEY_OWNER] = owner
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # refused before the handshake completes: the client sees a 403
            await receive()
            await send({"type": "websocket.close", "code": 1008, "reason": "Incorrect API key provided."})
            return
        error = ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        error.headers = {"WWW-Authenticate": "Bearer"}
        await error.response_for(scope.get("path", ""))(scope, receive, send)

    def _owner(self, scope: Scope) -> str | None:
        """The owner id of the key presented, or None when none of the keys is."""
        presented: list[bytes] = []
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    presented.append(token.strip())
            elif name == b"x-api-key":
                presented.append(value.strip())
        matched: bytes | None = None
        for key in presented:
            digest = hashlib.sha256(key).digest()
            for known in self._digests:
                if hmac.compare_digest(digest, known) and key != b"":
                    matched = known
        return None if matched is None else hashlib.sha256(b"owner:" + matched).hexdigest()[:32]


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return exc.response_for(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = (
            f"{param}: {first.get('msg', 'invalid value')}" if param else json.dumps(errors, default=str)
        )
        return ApiError(400, message, param=param).response_for(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = "not_found" if exc.status_code == 404 else None
        error = ApiError(exc.status_code, str(exc.detail), type=kind, code=code, headers=exc.headers)
        return error.response_for(request.url.path)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        error = ApiError(500, f"internal error: {type(exc).__name__}", type="server_error")
        return error.response_for(request.url.path)
