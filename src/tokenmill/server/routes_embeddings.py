"""POST /v1/embeddings: an embedding model's vectors, OpenAI's shapes.

``input`` is a string, a list of strings, a list of token ids or a list of such lists; each becomes one
prefill-only engine request (no KV kept: ``worker/pooling_runner.py``), batched by the same scheduler as
everything else. ``encoding_format`` "float" (lists) or "base64" (little-endian float32 bytes, what the openai SDK
asks for by default and decodes itself). ``dimensions`` is refused unless it is the model's own size: these
models were not trained to be cut (no Matryoshka). An input longer than the model takes is a 400, never cut.
"""

from __future__ import annotations

import base64
import uuid
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.sampling_params import SamplingParams
from tokenmill.server.common import (
    ApiError,
    ServerState,
    api_error,
    check_text_chars,
    parse_request,
    request_body,
    submit,
    tokenize_off_loop,
)
from tokenmill.server.protocol import ParamError, _Request
from tokenmill.server.respond import wait_for_results

router = APIRouter()
MAX_INPUTS = 2048  # OpenAI's bound on inputs per request


class EmbeddingRequest(_Request):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = None
    user: str | None = None  # a label for the caller's abuse tracking: nothing to do here


def _token_lists(state: ServerState, req: EmbeddingRequest) -> list[list[int]]:
    """Each input as token ids; ParamError for an empty one, too many, or one longer than the model takes."""
    raw = req.input
    inputs: list[Any] = [raw] if isinstance(raw, str) else list(raw)
    if inputs and isinstance(inputs[0], int):
        inputs = [inputs]  # one input given as token ids
    if not inputs:
        raise ParamError("input must not be empty", param="input")
    if len(inputs) > MAX_INPUTS:
        raise ParamError(f"input: at most {MAX_INPUTS} inputs per request, got {len(inputs)}", param="input")
    tokenizer = state.async_engine.tokenizer
    out = []
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            if not item:
                raise ParamError(f"input[{i}] must not be an empty string", param="input")
            check_text_chars(state, len(item), "input")
            ids = list(tokenizer.encode(item))
        else:
            ids = list(item)
            if not ids:
                raise ParamError(f"input[{i}] must not be an empty list of tokens", param="input")
        out.append(ids)
    return out


@router.post("/v1/embeddings", openapi_extra=request_body(EmbeddingRequest))
async def create_embeddings(request: Request) -> Response:
    state, req = await parse_request(request, EmbeddingRequest, task="embed")
    size = state.async_engine.embedding_size
    if req.dimensions is not None and req.dimensions != size:
        raise ApiError.bad_request(
            f"dimensions: {state.served_model_name} makes {size}-dimensional embeddings and does not support "
            f"others (got {req.dimensions})", param="dimensions",
        )  # fmt: skip
    embedded = await embed_inputs(request, state, req)
    if isinstance(embedded, Response):
        return embedded  # the client left
    vectors, num_tokens = embedded
    data = []
    for index, vector in enumerate(vectors):
        encoded: Any = vector
        if req.encoding_format == "base64":
            encoded = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    return JSONResponse({
        "object": "list", "data": data, "model": state.served_model_name,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    })  # fmt: skip


async def embed_inputs(
    request: Request, state: ServerState, req: EmbeddingRequest
) -> tuple[list[list[float]], int] | Response:
    """Each input's vector, in order, and the tokens they took; a 499 response when the client left first."""
    try:
        token_lists = await tokenize_off_loop(_token_lists, state, req)
    except ParamError as exc:
        raise api_error(exc) from None
    max_len = state.async_engine.max_model_len
    for i, ids in enumerate(token_lists):
        if len(ids) > max_len:
            raise ApiError.bad_request(
                f"This model's maximum context length is {max_len} tokens, however you requested {len(ids)} "
                f"tokens in input[{i}]. Please reduce your input.", param="input", code="context_length_exceeded",
            )  # fmt: skip
    if len(token_lists) > state.async_engine.max_queue:
        raise ApiError.bad_request(
            f"input: {len(token_lists)} inputs, and the server queues at most {state.async_engine.max_queue} "
            "(--max-queue); send fewer per request", param="input",
        )  # fmt: skip
    params = SamplingParams(max_tokens=0, temperature=0.0)
    group = await submit(state, [(ids, params) for ids in token_lists], f"embd-{uuid.uuid4().hex}")
    results = await wait_for_results(request, state, group)
    if isinstance(results, Response):
        return results
    return [r.embedding or [] for r in results], sum(len(ids) for ids in token_lists)
