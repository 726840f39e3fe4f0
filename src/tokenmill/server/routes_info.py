"""What the server says about itself: GET /health, /metrics, /v1/models, /v1/models/{id}, /version."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

import tokenmill
from tokenmill.server.common import ServerState, check_model, get_state, unavailable
from tokenmill.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from tokenmill.server.protocol import ModelCard, ModelList

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    async_engine = get_state(request).async_engine
    if async_engine.alive:
        return Response(status_code=200)
    return unavailable(async_engine.dead_message()).response()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(get_state(request).async_engine.metrics.render(), media_type=METRICS_CONTENT_TYPE)


def _model_card(state: ServerState) -> ModelCard:
    return ModelCard(
        id=state.served_model_name,
        root=state.async_engine.model_name,
        max_model_len=state.async_engine.max_model_len,
        quantization=state.async_engine.quantization,
        arithmetic=state.async_engine.arithmetic,
    )


def _adapter_card(state: ServerState, name: str) -> ModelCard:
    lora = state.lora_modules[name]
    return ModelCard(
        id=name,
        root=lora.lora_path,
        parent=state.served_model_name,
        max_model_len=state.async_engine.max_model_len,
    )


@router.get("/v1/models")
async def models(request: Request) -> Response:
    state = get_state(request)
    cards = [_model_card(state), *(_adapter_card(state, name) for name in sorted(state.lora_modules))]
    return JSONResponse(ModelList(data=cards).model_dump())


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str) -> Response:
    state = get_state(request)
    check_model(state, model_id)
    card = _adapter_card(state, model_id) if model_id in state.lora_modules else _model_card(state)
    return JSONResponse(card.model_dump())


@router.get("/version")
async def version() -> Response:
    return JSONResponse({"version": tokenmill.__version__})


ui_router = APIRouter()  # the chat page, unless the server runs with --no-ui


@ui_router.get("/", include_in_schema=False)
async def chat_page() -> Response:
    """A chat page in the browser over this server's own routes (``static/chat.html``: no CDN, no build step)."""
    from importlib import resources

    page = resources.files("tokenmill.server").joinpath("static/chat.html").read_text(encoding="utf-8")
    return HTMLResponse(page, headers={"Cache-Control": "no-cache"})
