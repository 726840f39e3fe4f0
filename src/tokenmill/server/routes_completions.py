"""POST /v1/completions: one engine request per (prompt, choice); choice ``i`` of prompt ``p`` is index
``p * n + i`` and, with a seed, samples with ``seed + i``."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from tokenmill.generation_defaults import COMPLETIONS_MAX_TOKENS
from tokenmill.outputs import Logprob, RequestDelta
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
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ParamError,
    to_sampling_params,
)
from tokenmill.server.respond import OpenAIView, respond

router = APIRouter()


@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]


@router.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
async def create_completion(request: Request) -> Response:
    state, req = await parse_request(request, CompletionRequest)
    try:
        prompts = await tokenize_off_loop(_prompts, req, state)  # tokenizing off the event loop
        n = req.num_choices
        if req.suffix:
            raise ParamError("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != n:
            raise ParamError("best_of is not supported (only best_of == n)", param="best_of")
        max_tokens = COMPLETIONS_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        echo = bool(req.echo)
        engine_prompts = []
        for prompt in prompts:
            for i in range(n):
                params = to_sampling_params(
                    req,
                    max_tokens=fit_max_tokens(state, len(prompt.token_ids), max_tokens),
                    logprobs=req.logprobs,
                    prompt_logprobs=req.logprobs if echo and req.logprobs is not None else None,
                    seed=None if req.seed is None else req.seed + i,
                    defaults=state.async_engine.sampling_defaults,
                )
                engine_prompts.append((prompt.token_ids, params))
    except ParamError as exc:
        raise api_error(exc) from None

    completion_id = f"cmpl-{uuid.uuid4().hex}"
    group: RequestGroup = await submit(
        state,
        engine_prompts,
        completion_id,
        req.cache_salt,
        structured_param=req.structured()[1],
        model=req.model,
    )
    view = _View(state, req, completion_id, [p for p in prompts for _ in range(n)])
    view.model = answering_model(state, req.model)
    return await respond(request, state, view, group, bool(req.stream))


def _prompts(req: CompletionRequest, state: ServerState) -> list[_Prompt]:
    raw = req.prompt
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif raw and all(isinstance(t, int) for t in raw):
        items = [raw]
    else:
        items = list(raw)
    if not items:
        raise ParamError("prompt must not be empty", param="prompt")
    tokenizer = state.async_engine.tokenizer
    vocab_size = tokenizer.vocab_size
    prompts = []
    for item in items:
        if isinstance(item, str):
            if item == "":
                raise ParamError("prompt must not be empty", param="prompt")
            check_text_chars(state, len(item), "prompt")
            prompts.append(_Prompt(item, tokenizer.encode(item)))
            continue
        if not item:
            raise ParamError("prompt must not be empty", param="prompt")
        for tok in item:
            if not 0 <= tok < vocab_size:
                raise ParamError(
                    f"prompt: token id {tok} is out of vocabulary (valid ids are 0..{vocab_size - 1})",
                    param="prompt",
                )
        prompts.append(_Prompt(None, list(item)))
    return prompts


@dataclass
class _LogprobBuilder:
    """OpenAI's legacy logprobs for one choice; ``text_offset`` counts characters from the choice's start."""

    offset: int = 0
    parts: CompletionLogprobs = field(default_factory=CompletionLogprobs)

    def add(self, token_str: str, logprob: float | None, top: dict[str, float] | None) -> None:
        self.parts.tokens.append(token_str)
        self.parts.token_logprobs.append(logprob)
        self.parts.top_logprobs.append(top)
        self.parts.text_offset.append(self.offset)
        self.offset += len(token_str)

    def take(self) -> CompletionLogprobs:
        out, self.parts = self.parts, CompletionLogprobs()
        return out


class _View(OpenAIView):
    """Turns engine deltas into OpenAI completion objects for one HTTP request."""

    chunk_class = CompletionChunk

    def __init__(
        self, state: ServerState, req: CompletionRequest, completion_id: str, prompts: list[_Prompt]
    ):
        num_prompt_tokens = sum(
            len(p.token_ids) for i, p in enumerate(prompts) if i == 0 or p is not prompts[i - 1]
        )
        super().__init__(state, completion_id, req.include_usage, num_prompt_tokens)
        self.echo = bool(req.echo)
        self.want_logprobs = req.logprobs is not None
        self.choice_prompts = prompts  # per choice index
        self.cached_by_choice = [0] * len(prompts)
        # streaming, per choice: its legacy logprobs so far, and whether its first delta went out
        self.builders = [_LogprobBuilder() for _ in prompts]
        self.started = [False] * len(prompts)

    # --- respond.View ----------------------------------------------------------------------------------
    def opening_events(self, num_choices: int) -> list[str]:
        return []

    def event(self, index: int, delta: RequestDelta) -> str | None:
        self.saw(index, delta.num_cached_tokens)
        choice = self.delta_choice(index, delta, not self.started[index], self.builders[index])
        self.started[index] = True
        return None if choice is None else self.chunk(choice)

    def saw(self, index: int, num_cached_tokens: int) -> None:
        self.cached_by_choice[index] = max(self.cached_by_choice[index], num_cached_tokens)

    def num_cached_tokens(self) -> int:
        """Each prompt's cached tokens are the most any of its choices got."""
        cached: dict[int, int] = {}
        for prompt, n in zip(self.choice_prompts, self.cached_by_choice, strict=True):
            cached[id(prompt)] = max(cached.get(id(prompt), 0), n)
        return sum(cached.values())

    def prompt_text(self, index: int) -> str:
        prompt = self.choice_prompts[index]
        return prompt.text if prompt.text is not None else str(self.tokenizer.decode(prompt.token_ids))

    def add_prompt_logprobs(
        self, builder: _LogprobBuilder, index: int, entries: list[Logprob | None] | None
    ) -> None:
        prompt_ids = self.choice_prompts[index].token_ids
        entries = list(entries or [])
        for pos, token_id in enumerate(prompt_ids):
            entry = entries[pos] if pos < len(entries) else None
            if entry is None:
                builder.add(self.token_str(token_id), None, None)
            else:
                builder.add(self.token_str(token_id), entry.logprob, self.top_dict(entry))

    def add_logprobs(
        self, builder: _LogprobBuilder, token_ids: list[int], logprobs: list[Logprob] | None
    ) -> None:
        for pos, token_id in enumerate(token_ids):
            entry = logprobs[pos] if logprobs and pos < len(logprobs) else None
            if entry is None:
                builder.add(self.token_str(token_id), None, None)
            else:
                builder.add(self.token_str(token_id), entry.logprob, self.top_dict(entry))

    def top_dict(self, entry: Logprob) -> dict[str, float]:
        top = {self.token_str(tid): lp for tid, lp in entry.top_logprobs}
        top.setdefault(self.token_str(entry.token_id), entry.logprob)  # the sampled token is always there
        return top

    def response(self, results: list[ChoiceResult]) -> CompletionResponse:
        for index, result in enumerate(results):
            self.saw(index, result.num_cached_tokens)
        choices = []
        for index, result in enumerate(results):
            text = result.text
            logprobs = None
            if self.echo:
                text = self.prompt_text(index) + text
            if self.want_logprobs:
                builder = _LogprobBuilder()
                if self.echo:
                    self.add_prompt_logprobs(builder, index, result.prompt_logprobs)
                self.add_logprobs(builder, result.token_ids, result.logprobs)
                logprobs = builder.take()
            choices.append(
                CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=result.finish_reason,
                    stop_reason=result.stop_reason,
                )
            )
        return CompletionResponse(choices=choices, **self.envelope(sum(len(r.token_ids) for r in results)))

    def delta_choice(
        self, index: int, delta: RequestDelta, first: bool, builder: _LogprobBuilder
    ) -> CompletionChoice | None:
        text = delta.new_text
        if first and self.echo:
            text = self.prompt_text(index) + text
            if self.want_logprobs:
                self.add_prompt_logprobs(builder, index, delta.prompt_logprobs)
        if self.want_logprobs:
            self.add_logprobs(builder, delta.new_token_ids, delta.new_logprobs)
        logprobs = builder.take() if self.want_logprobs else None
        if not text and not delta.finished and not (logprobs and logprobs.tokens):
            return None  # tokens whose text is held back (an incomplete character or a possible stop string)
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason if delta.finished else None,
            stop_reason=delta.stop_reason if delta.finished else None,
        )
