"""vLLM's tokenizer routes: GET /tokenizer_info (what lm-eval's ``tokenizer_backend=remote`` reads), POST
/tokenize (a prompt, or messages through the chat template) and POST /detokenize."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokenmill.server.common import (
    ApiError,
    api_error,
    check_text_chars,
    get_state,
    parse_request,
    request_body,
    tokenize_off_loop,
)
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ParamError,
    TokenizeRequest,
    TokenizeResponse,
)
from tokenmill.server.routes_chat import encode_messages

router = APIRouter()


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> Response:
    state = get_state(request)
    tokenizer = state.async_engine.tokenizer
    eos_ids = sorted(getattr(tokenizer, "eos_token_ids", ()))
    bos_id = getattr(tokenizer, "bos_token_id", None)

    def token(token_id: int | None) -> str | None:
        return None if token_id is None else str(tokenizer.id_to_token(token_id))

    return JSONResponse(
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": state.async_engine.max_model_len,
            "vocab_size": tokenizer.vocab_size,
            "bos_token": token(bos_id),
            "bos_token_id": bos_id,
            "eos_token": token(eos_ids[0]) if eos_ids else None,
            "eos_token_id": eos_ids[0] if eos_ids else None,
            "eos_token_ids": eos_ids,
            "pad_token": None,
            "chat_template": getattr(tokenizer, "chat_template", None),
        }
    )


@router.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
async def tokenize(request: Request) -> Response:
    state, req = await parse_request(request, TokenizeRequest, task=None)
    tokenizer = state.async_engine.tokenizer
    try:
        if req.messages is not None:
            chat = ChatCompletionRequest(
                messages=req.messages, add_generation_prompt=req.add_generation_prompt
            )
            tokens = await tokenize_off_loop(encode_messages, state, chat)  # off the event loop
        elif req.prompt is not None:
            add_special = req.add_special_tokens is not False
            check_text_chars(state, len(req.prompt), "prompt")
            tokens = list(await tokenize_off_loop(tokenizer.encode, req.prompt, add_special))
        else:
            raise ParamError("either prompt or messages is required", param="prompt")
    except ParamError as exc:
        raise api_error(exc) from None
    token_strs = [str(tokenizer.id_to_token(t)) for t in tokens] if req.return_token_strs else None
    body = TokenizeResponse(
        count=len(tokens),
        max_model_len=state.async_engine.max_model_len,
        tokens=tokens,
        token_strs=token_strs,
    )
    return JSONResponse(body.model_dump(exclude_none=True))


@router.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
async def detokenize(request: Request) -> Response:
    state, req = await parse_request(request, DetokenizeRequest, task=None)
    tokenizer = state.async_engine.tokenizer
    for tok in req.tokens:
        if not 0 <= tok < tokenizer.vocab_size:
            raise ApiError.bad_request(
                f"tokens: token id {tok} is out of vocabulary (valid ids are 0..{tokenizer.vocab_size - 1})",
                param="tokens",
            )
    text = await run_in_threadpool(tokenizer.decode, req.tokens)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump())
