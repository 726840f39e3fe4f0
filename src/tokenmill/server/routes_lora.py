"""LoRA adapters loaded and unloaded while the server runs (vLLM's routes; mounted only with
``TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING=1``, or vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, as vLLM mounts them):
POST /v1/load_lora_adapter ``{"lora_name", "lora_path"}`` and POST /v1/unload_lora_adapter ``{"lora_name"}``. The
adapter loads on the engine thread between steps; requests running meanwhile are not disturbed."""

from __future__ import annotations

import os

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from tokenmill.errors import BadRequestError
from tokenmill.lora_request import LoRARequest
from tokenmill.server.common import ApiError, ServerState, parse_request

router = APIRouter()
ENV_FLAGS = ("TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updating_allowed() -> bool:
    return any(os.environ.get(name, "").strip().lower() in ("1", "true") for name in ENV_FLAGS)


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


def _names_taken(state: ServerState, name: str) -> bool:
    return name in state.lora_modules or name == state.served_model_name or name in state.model_aliases


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    state, req = await parse_request(request, LoadLoRAAdapterRequest, task="generate")
    if _names_taken(state, req.lora_name):
        raise ApiError.bad_request(
            f"The lora adapter '{req.lora_name}' has already been loaded.", param="lora_name"
        )
    lora_id = 1 + max((lora.lora_int_id for lora in state.lora_modules.values()), default=0)
    lora = LoRARequest(req.lora_name, lora_id, req.lora_path)
    try:
        await state.async_engine.run_on_engine(lambda engine: engine.add_lora(lora))
    except BadRequestError as exc:
        raise ApiError.bad_request(exc.message, param="lora_path") from None
    state.lora_modules[req.lora_name] = lora
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    state, req = await parse_request(request, UnloadLoRAAdapterRequest, task="generate")
    lora = state.lora_modules.get(req.lora_name)
    if lora is None:
        raise ApiError(404, f"The lora adapter '{req.lora_name}' cannot be found.", type="NotFoundError",
                       param="lora_name", code="model_not_found")  # fmt: skip
    try:
        await state.async_engine.run_on_engine(lambda engine: engine.remove_lora(lora.lora_int_id))
    except BadRequestError as exc:
        raise ApiError.bad_request(exc.message, param="lora_name") from None
    del state.lora_modules[req.lora_name]
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
