"""Ollama's API on the same server: ``/api/chat``, ``/api/generate``, ``/api/embed`` (and the older
``/api/embeddings``), ``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/version``, ``HEAD /``.

A chat or generate request becomes a chat request (``protocol_ollama``) and goes through ``routes_chat.plan_chat``
and the chat view (reasoning, tool calls); its answer is Ollama's: newline-delimited JSON objects by default
(``stream: false``: one object), the last with ``done: true``, ``done_reason`` and the counts and nanosecond
durations made from the engine's own timestamps (``RequestMetrics``): ``total_duration`` (arrival to finish),
``load_duration`` (0: the model is loaded before the server answers), ``prompt_eval_count`` and
``prompt_eval_duration`` (the prefill), ``eval_count`` and ``eval_duration`` (the decode). Errors are Ollama's
shape, ``{"error": "..."}`` with the status.
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill import __version__
from tokenmill.outputs import RequestDelta, RequestMetrics
from tokenmill.server.async_engine import ChoiceResult, ModelFacts
from tokenmill.server.common import (
    ApiError,
    ServerState,
    SSEResponse,
    api_error,
    check_model,
    get_state,
    parse_request,
    read_json_body,
    submit,
    tokenize_off_loop,
)
from tokenmill.server.protocol import ParamError
from tokenmill.server.protocol_ollama import (
    ChatRequest,
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    ShowRequest,
)
from tokenmill.server.respond import wait_for_results
from tokenmill.server.routes_chat import _ChatView, plan_chat, reasoning_for

router = APIRouter()
OLLAMA_API_VERSION = "0.12.0"  # the Ollama API these routes follow (its clients read /api/version)


class NDJSONResponse(SSEResponse):
    media_type = "application/x-ndjson"


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse({"error": exc.info.message}, status_code=exc.status_code, headers=exc.headers)


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: float | None) -> int:
    return 0 if seconds is None else int(seconds * 1e9)


def _stats(metrics: RequestMetrics | None, num_prompt_tokens: int, num_output_tokens: int) -> dict[str, Any]:
    m = metrics
    return {
        "total_duration": _ns(m.e2e_time_s if m else None), "load_duration": 0,
        "prompt_eval_count": num_prompt_tokens, "prompt_eval_duration": _ns(m.prefill_time_s if m else None),
        "eval_count": num_output_tokens, "eval_duration": _ns(m.decode_time_s if m else None),
    }  # fmt: skip


class _OllamaView:
    """Ollama's objects for one chat (``message``) or generate (``response``) request, made from the chat view's
    own answer (reasoning split, tool calls parsed)."""

    def __init__(self, chat: _ChatView, model: str, generate: bool, num_prompt_tokens: int) -> None:
        self.chat = chat
        self.model = model
        self.generate = generate
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = 0
        self.metrics: RequestMetrics | None = None
        self.done_reason = "stop"

    def body(
        self, content: str, thinking: str | None, tool_calls: list[Any] | None, done: bool
    ) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": _now()}
        if self.generate:
            out["response"] = content
            if thinking:
                out["thinking"] = thinking
        else:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if tool_calls:
                message["tool_calls"] = tool_calls
            out["message"] = message
        out["done"] = done
        if done:
            out["done_reason"] = self.done_reason
            out.update(_stats(self.metrics, self.num_prompt_tokens, self.num_output_tokens))
        return out

    @staticmethod
    def calls(tool_calls: Any) -> list[dict[str, Any]] | None:
        if not tool_calls:
            return None
        out = []
        for call in tool_calls:
            function = call.function if hasattr(call, "function") else call["function"]
            name = function.name if hasattr(function, "name") else function["name"]
            arguments = function.arguments if hasattr(function, "arguments") else function["arguments"]
            out.append({"function": {"name": name, "arguments": json.loads(arguments)}})
        return out

    # --- respond.View ---------------------------------------------------------------------------------
    def opening_events(self, num_choices: int) -> list[str]:
        return []  # Ollama's first object comes with the first token

    def keepalive_event(self) -> str:
        return ""  # every line is an object: no keep-alive line

    def event(self, index: int, delta: RequestDelta) -> str | None:
        self.num_output_tokens += len(delta.new_token_ids)
        if delta.finished:
            self.metrics = delta.metrics
            self.done_reason = "length" if delta.finish_reason == "length" else "stop"
        choice = self.chat.delta_choice(index, delta)
        if choice is None:
            return None
        d = choice.delta
        if not (d.content or d.reasoning or d.tool_calls):
            return None
        return (
            json.dumps(self.body(d.content or "", d.reasoning, self.calls(d.tool_calls), done=False)) + "\n"
        )

    def closing_events(self, num_completion_tokens: int, metrics: Any = None) -> list[str]:
        return [json.dumps(self.body("", None, None, done=True)) + "\n"]

    def error_events(self, error: ApiError) -> list[str]:
        return [json.dumps({"error": error.info.message}) + "\n"]

    def whole(self, result: ChoiceResult) -> dict[str, Any]:
        self.metrics, self.num_output_tokens = result.metrics, len(result.token_ids)
        message, finish_reason = self.chat.message(result.text, result.finish_reason)
        self.done_reason = "length" if finish_reason == "length" else "stop"
        calls = self.calls(message.tool_calls)
        return self.body(message.content or "", message.reasoning, calls, done=True)


async def _answer(request: Request, generate: bool) -> Response:
    try:
        state, req = await parse_request(request, GenerateRequest if generate else ChatRequest)
        if req.think and state.reasoning_parser is None:
            raise ApiError.bad_request(f'"{req.model}" does not support thinking')
        chat = req.to_chat(state.async_engine.max_model_len)
        plan = await tokenize_off_loop(plan_chat, state, chat)
        options = req.options or {}
        if options.get("num_ctx") is not None and len(plan.prompt_ids) >= options["num_ctx"]:
            raise ParamError(
                f"the prompt's {len(plan.prompt_ids)} tokens fill options.num_ctx", param="options.num_ctx"
            )
        if options.get("num_ctx") is not None:
            room = options["num_ctx"] - len(plan.prompt_ids)
            plan.engine_prompts = [(ids, _capped(p, room)) for ids, p in plan.engine_prompts]
        group = await submit(
            state,
            plan.engine_prompts,
            f"ollama-{time.time_ns()}",
            structured_param=plan.structured_param,
            model=req.model,
        )
    except ParamError as exc:
        return _error(api_error(exc))
    except ApiError as exc:
        return _error(exc)
    view = _ChatView(state, chat, "ollama", len(plan.prompt_ids))
    view.reasoning = reasoning_for(state, chat, plan.prompt_ids)
    if req.think is False and view.reasoning is not None:
        view.reasoning.included = False
    ollama = _OllamaView(view, req.model, generate, len(plan.prompt_ids))
    if req.stream:
        from tokenmill.server.respond import events

        return NDJSONResponse(events(ollama, group, state), on_disconnect=group.abort)
    try:
        results = await wait_for_results(request, state, group)
    except ApiError as exc:
        return _error(exc)
    if isinstance(results, Response):
        return results
    return JSONResponse(ollama.whole(results[0]))


def _capped(params: Any, room: int) -> Any:
    from dataclasses import replace

    return replace(params, max_tokens=min(params.max_tokens, room))


@router.post("/api/chat")
async def chat(request: Request) -> Response:
    return await _answer(request, generate=False)


@router.post("/api/generate")
async def generate(request: Request) -> Response:
    return await _answer(request, generate=True)


@router.post("/api/embed")
async def embed(request: Request) -> Response:
    from tokenmill.server.routes_embeddings import EmbeddingRequest, embed_inputs

    started = time.perf_counter()
    try:
        state, req = await parse_request(request, EmbedRequest, task="embed")
        if req.options:
            raise ApiError.bad_request(f"options.{sorted(req.options)[0]}: not supported for embeddings")
        size = state.async_engine.embedding_size
        if req.dimensions is not None and req.dimensions != size:
            raise ApiError.bad_request(
                f"dimensions: {state.served_model_name} makes {size}-dimensional embeddings"
            )
        embedded = await embed_inputs(request, state, EmbeddingRequest(input=req.input))
    except ApiError as exc:
        return _error(exc)
    if isinstance(embedded, Response):
        return embedded
    vectors, num_tokens = embedded
    return JSONResponse({
        "model": req.model, "embeddings": vectors, "total_duration": _ns(time.perf_counter() - started),
        "load_duration": 0, "prompt_eval_count": num_tokens,
    })  # fmt: skip


@router.post("/api/embeddings")
async def embeddings(request: Request) -> Response:
    from tokenmill.server.routes_embeddings import EmbeddingRequest, embed_inputs

    try:
        state, req = await parse_request(request, EmbeddingsRequest, task="embed")
        if req.options:
            raise ApiError.bad_request(f"options.{sorted(req.options)[0]}: not supported for embeddings")
        embedded = await embed_inputs(request, state, EmbeddingRequest(input=req.prompt))
    except ApiError as exc:
        return _error(exc)
    if isinstance(embedded, Response):
        return embedded
    return JSONResponse({"embedding": embedded[0][0]})


def _facts(state: ServerState) -> ModelFacts:
    facts = state.async_engine.facts
    if facts is None:
        raise ApiError(503, "the model's facts are not known", type="server_error")
    return facts


def _details(facts: ModelFacts) -> dict[str, Any]:
    count = facts.num_parameters
    return {
        "parent_model": "", "format": "gguf" if facts.source.endswith(".gguf") else "safetensors",
        "family": facts.family, "families": [facts.family],
        "parameter_size": f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.0f}M",
        "quantization_level": facts.file_type,
    }  # fmt: skip


def _modified_at(facts: ModelFacts) -> str:
    import os

    try:
        mtime = os.path.getmtime(facts.source)
    except OSError:
        mtime = 0.0
    return datetime.fromtimestamp(mtime, UTC).isoformat().replace("+00:00", "Z")


def _listed(state: ServerState) -> dict[str, Any]:
    facts = _facts(state)
    digest = hashlib.sha256(f"{facts.source}:{facts.file_bytes}".encode()).hexdigest()  # names this file here
    return {
        "name": state.served_model_name, "model": state.served_model_name, "modified_at": _modified_at(facts),
        "size": facts.file_bytes, "digest": digest, "details": _details(facts),
    }  # fmt: skip


@router.get("/api/tags")
async def tags(request: Request) -> Response:
    try:
        return JSONResponse({"models": [_listed(get_state(request))]})
    except ApiError as exc:
        return _error(exc)


@router.get("/api/ps")
async def ps(request: Request) -> Response:
    try:
        entry = {**_listed(get_state(request)), "expires_at": "2318-01-01T00:00:00Z", "size_vram": 0}
    except ApiError as exc:
        return _error(exc)
    entry.pop("modified_at")
    return JSONResponse({"models": [entry]})


@router.post("/api/show")
async def show(request: Request) -> Response:
    try:
        state, req = await parse_request(request, ShowRequest, task="any")
        name = req.model or req.name
        if name is None:
            raise ApiError.bad_request("model is required")
        check_model(state, name)
    except ApiError as exc:
        return _error(exc)
    engine = state.async_engine
    facts = _facts(state)
    capabilities = ["embedding"] if engine.is_pooling else ["completion"]
    template = getattr(engine.tokenizer, "chat_template", None) or ""
    if "tools" in template:
        capabilities.append("tools")
    if state.reasoning_parser is not None:
        capabilities.append("thinking")
    arch = facts.family
    info = {
        "general.architecture": arch, "general.parameter_count": facts.num_parameters,
        f"{arch}.context_length": engine.max_model_len, f"{arch}.embedding_length": facts.hidden_size,
        f"{arch}.block_count": facts.num_layers,
    }  # fmt: skip
    return JSONResponse({
        "modelfile": f"FROM {facts.source}\n", "parameters": "", "template": template, "details": _details(facts),
        "model_info": info, "capabilities": capabilities, "modified_at": _modified_at(facts),
    })  # fmt: skip


@router.get("/api/version")
async def version() -> Response:
    return JSONResponse({"version": OLLAMA_API_VERSION, "tokenmill": __version__})


@router.head("/")
async def root_head() -> Response:
    return Response(status_code=200)


@router.post("/api/pull")
async def pull(request: Request) -> Response:
    """``tokenmill pull`` as Ollama's: progress objects (``status``, and ``completed`` bytes while the file
    grows) as newline-delimited JSON, ``{"status": "success"}`` last; ``stream: false``: that one object. It
    fetches into the cache for ``tokenmill serve --model NAME``; this server keeps serving its own model."""
    import asyncio

    from starlette.concurrency import run_in_threadpool

    from tokenmill.model import registry as models

    state = get_state(request)
    body = await read_json_body(request, state.max_body_bytes)
    name = body.get("model") or body.get("name") if isinstance(body, dict) else None
    unknown = sorted(set(body) - {"model", "name", "stream", "insecure"}) if isinstance(body, dict) else []
    if not isinstance(name, str) or unknown:
        return _error(
            ApiError.bad_request(f"{unknown[0]}: not supported" if unknown else "model is required")
        )
    if models.catalogue_name(name) not in models.CATALOGUE:
        return _error(ApiError(404, f"pull model manifest: {name!r} is not in tokenmill's catalogue "
                                    f"({', '.join(models.CATALOGUE)})"))  # fmt: skip
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    done = {"completed": 0}

    def grew(n: int) -> None:
        done["completed"] += n
        loop.call_soon_threadsafe(
            queue.put_nowait, {"status": f"pulling {name}", "completed": done["completed"]}
        )

    async def fetch() -> None:
        try:
            await queue.put({"status": "pulling manifest"})
            await run_in_threadpool(
                models.pull, models.catalogue_name(name), progress=False, log=lambda s: None, on_bytes=grew
            )
            await queue.put({"status": "verifying sha256 digest"})
            await queue.put({"status": "success"})
        except Exception as exc:  # a part pip cannot get, a wrong digest: said in Ollama's shape
            await queue.put({"error": f"pull failed: {exc}"})
        await queue.put(None)

    task = asyncio.ensure_future(fetch())

    async def lines() -> Any:
        while (item := await queue.get()) is not None:
            yield json.dumps(item) + "\n"

    if body.get("stream", True) is False:
        last: dict[str, Any] = {}
        async for line in lines():
            last = json.loads(line)
        await task
        return JSONResponse(last, status_code=500 if "error" in last else 200)
    return NDJSONResponse(lines(), on_disconnect=lambda: None)
