"""The OpenAI wire protocol as pydantic models: requests in, responses and stream chunks out.

Requests are strict: a field tokenmill does not implement (``audio``, a typo) is a 400
naming it, never silently ignored, and JSON types are not coerced (``"stream": "yes"`` and ``"n": "2"`` are
400s). Every known field may be ``null``, which means "the default". Range checks live in
:class:`~tokenmill.sampling_params.SamplingParams`, so one place decides what a valid temperature is;
:func:`to_sampling_params` maps a request onto it and re-raises its ``ValueError`` as a
:class:`ParamError` naming the request field a client sent.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from tokenmill.errors import BadRequestError
from tokenmill.generation_defaults import for_request
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

MAX_N = 128  # choices per request: each is its own engine request
MAX_STOP_STRINGS = 16  # OpenAI allows 4; vLLM has no bound. Each is checked against the text at every token.
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
ROLES = ("system", "developer", "user", "assistant", "tool")


# A bad request parameter (a 400 with ``param`` set): the library's own error, under the name the routes use.
ParamError = BadRequestError


def model_of_type(models: dict[str, Any], kind: object, param: str, what: str, supported: str) -> Any:
    """The model ``models`` has for a tagged object's ``type`` (``kind``); a 400 naming ``param`` for any other
    type, saying which are ``supported``."""
    model = models.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ParamError(f"{param}: {what} type {kind!r} is not supported ({supported})", param=param)
    return model


# --- requests ---------------------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool | None = False


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Request):
    """vLLM's ``structured_outputs`` request field."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def model_dump(self, **kw: Any) -> dict[str, Any]:  # type: ignore[override]
        out = super().model_dump(**kw)
        if "json_" in out:
            out["json"] = out.pop("json_")
        return out


class _SamplingFields(_Request):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = 0
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    cache_salt: str | None = None  # requests with different salts never share prefix-cache blocks
    # Constrained decoding: OpenAI's response_format, vLLM's structured_outputs and its older guided_* names.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's constraint and the field that gave it; ParamError for two at once or a bad one."""
        given: list[tuple[str, dict[str, Any]]] = []
        if self.response_format is not None and self.response_format.type != "text":
            rf = self.response_format
            if rf.type == "json_object":
                given.append(("response_format", {"json_object": True}))
            else:
                if rf.json_schema is None or rf.json_schema.schema_ is None:
                    raise ParamError(
                        "response_format: json_schema.schema is required", param="response_format"
                    )
                given.append(("response_format", {"json": rf.json_schema.schema_}))
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(exclude_none=True)
            if fields.get("json_object") is False:
                del fields["json_object"]
            given.append(("structured_outputs", fields))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):  # fmt: skip
            if getattr(self, name) is not None:
                given.append((name, {key: getattr(self, name)}))
        if not given:
            return None, None
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            raise ParamError(f"give one output constraint, got {names}", param=given[1][0])
        name, fields = given[0]
        try:
            return StructuredOutputsParams(**fields), name
        except ValueError as exc:
            raise ParamError(str(exc).replace("structured_outputs", name, 1), param=name) from None

    def check_stops(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ParamError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", param="stop")
        if any(len(stop) > MAX_STOP_STRING_CHARS for stop in stops):
            raise ParamError(
                f"stop: each stop string is at most {MAX_STOP_STRING_CHARS} characters", param="stop"
            )
        if len(self.stop_token_ids or []) > MAX_STOP_TOKEN_IDS:
            raise ParamError(
                f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids or [])}",
                param="stop_token_ids",
            )

    @property
    def num_choices(self) -> int:
        n = 1 if self.n is None else self.n
        if not 1 <= n <= MAX_N:
            raise ParamError(f"n must be between 1 and {MAX_N}, got {n}", param="n")
        return n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class FunctionCallIn(_Request):
    name: str
    arguments: str = "{}"


class ToolCallIn(_Request):
    """An earlier call, in an assistant message of the history."""

    index: int | None = None  # the openai SDK's streamed calls carry it; accumulated history keeps it
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class FunctionDef(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant only
    tool_call_id: str | None = None  # tool only
    # What the openai SDK's ``message.model_dump()`` carries, so that a reply appended to the history as it
    # came back is accepted: a refusal is what the assistant said (its text when content is null), annotations
    # are citations about that text; the legacy function_call is an earlier call. Audio in the history is
    # refused: tokenmill has no audio.
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: None = None
    function_call: FunctionCallIn | None = None

    @model_validator(mode="after")
    def _content_only_null_for_assistant(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":  # OpenAI: only an assistant turn may omit it
            raise ValueError(f"content is required for a {self.role} message (null only for assistant)")
        if (self.tool_calls is not None or self.function_call is not None) and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        return self

    def calls(self) -> list[FunctionCallIn]:
        """The calls this (assistant) message made: its tool_calls, or the legacy function_call."""
        found = [c.function for c in self.tool_calls or []]
        return found + ([self.function_call] if self.function_call is not None else [])

    def text(self) -> str:
        """The message's content as one string (text parts joined); ParamError for non-text parts."""
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        pieces = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ParamError(
                    f"only text content parts are supported, got type {part.get('type')!r}", param="messages"
                )
            pieces.append(part["text"])
        return "".join(pieces)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: more variables for the chat template (Qwen3's enable_thinking), and whether a reasoning model's
    # thinking is returned (--reasoning-parser)
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool | None = True
    # OpenAI fields whose values below ask for nothing tokenmill would have to do (a value that asks for
    # something it does not do is a 400 naming the field): nothing is stored (store true is refused),
    # metadata only labels a stored completion, "auto"/"default" is the one service tier there is, text is
    # the only modality, and a prediction is only a speed hint (accepted when absent).
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default"] | None = None
    modalities: list[Literal["text"]] | None = None
    audio: None = None
    prediction: None = None

    @field_validator("store")
    @classmethod
    def _nothing_is_stored(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError(
                "store: true is not supported (tokenmill keeps no completions); send false or omit it"
            )
        return value

    def active_tools(self) -> list[dict[str, Any]]:
        """The tools the model may call (none with tool_choice "none"); ParamError for a bad choice."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []]
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) != len(names):
            raise ParamError("tools: function names must be distinct", param="tools")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise ParamError(
                    f"tool_choice names function {choice.function.name!r}, which is not in tools",
                    param="tool_choice",
                )
            return [t for t in tools if t["function"]["name"] == choice.function.name]
        if choice in ("required",) and not tools:
            raise ParamError('tool_choice "required" needs tools', param="tool_choice")
        return [] if choice == "none" else tools

    @property
    def forces_tool_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def template_messages(self, parser: str = "hermes") -> list[dict[str, str]]:
        """The history as the chat template takes it; earlier tool calls written back in the model's format."""
        from tokenmill.server.tool_calls import render_call

        if not self.messages:
            raise ParamError("messages must not be empty", param="messages")
        out = []
        for m in self.messages:
            content = m.text()
            for call in m.calls():
                try:
                    rendered = render_call(call.name, call.arguments, parser)
                except ValueError as exc:
                    raise ParamError(
                        f"tool_calls: arguments must be a JSON object string ({exc})", param="messages"
                    ) from None
                content = f"{content}\n{rendered}" if content else rendered
            out.append({"role": m.role, "content": content})
        return out


class TokenizeRequest(_Request):
    """vLLM's /tokenize: either ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True
    return_token_strs: bool | None = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# --- responses --------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _Envelope(BaseModel):
    """The fields every completion object and stream chunk carries around its choices."""

    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class CompletionResponse(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionChunk(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    # a reasoning model's thinking (--reasoning-parser): vLLM's field, and its older name
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _reasoning_when_set(self, handler: Any) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if self.reasoning is None:
            out.pop("reasoning", None)
            out.pop("reasoning_content", None)
        return out


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    """Only the fields set are sent: ``{"role": "assistant", "content": ""}`` first, then ``{"content": ...}``."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's chunks: index, id, type, function
    reasoning: str | None = None  # a reasoning model's thinking, also sent as reasoning_content (vLLM's)

    @model_serializer
    def _drop_unset(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.role is not None:
            out["role"] = self.role
        if self.reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = self.reasoning
        if self.content is not None:
            out["content"] = self.content
        if self.tool_calls is not None:
            out["tool_calls"] = self.tool_calls
        return out


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenmill"
    root: str | None = None
    max_model_len: int
    # tokenmill's own: the quantization that runs (``--quantization``) and why (model/arithmetic.py)
    quantization: str | None = None
    arithmetic: str | None = None
    parent: str | None = None  # a LoRA adapter's: the model it runs on (vLLM's field)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# --- mapping ----------------------------------------------------------------------------------------


def validation_error_to_param(exc: ValidationError) -> ParamError:
    """The first pydantic error as a ParamError naming the field (``messages.0.role``)."""
    errors = exc.errors(include_url=False)
    if not errors:
        return ParamError(str(exc))
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ())]
    # A union reports the member type it tried (``prompt.str``, ``stop.list[str]``); keep the field path.
    path = [p for p in loc if not _is_type_tag(p)]
    param = ".".join(path) or None
    message = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        message = f"{param} is required" if param else "a required field is missing"
    elif param:
        message = f"{param}: {message}"
    return ParamError(message, param=param)


ToolT = TypeVar("ToolT", bound=BaseModel)


def validate_tools(
    raw_tools: list[Any] | None, model: type[ToolT], kinds: tuple[str | None, ...], refusal: str, index: str
) -> list[ToolT]:
    """Each tool of a Responses or Messages request as ``model``: one whose ``type`` is not in ``kinds`` is a
    ParamError (``refusal`` says why), as is one ``model`` does not validate; ``index`` writes the path of tool
    ``i`` (``"tools[{i}]"`` for OpenAI, ``"tools.{i}"`` for Anthropic)."""
    tools = []
    for i, raw in enumerate(raw_tools or []):
        where = index.format(i=i)
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind not in kinds:
            raise ParamError(
                f"{where}.type: tool type {kind!r} is not supported ({refusal})", param=f"{where}.type"
            )
        try:
            tools.append(model.model_validate(raw))
        except ValidationError as exc:
            inner = validation_error_to_param(exc)
            raise ParamError(f"{where}.{inner.message}", param=f"{where}.{inner.param}") from None
    return tools


def _is_type_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool") or "[" in part or part.startswith("function-")


# SamplingParams field -> the request field a client would have sent.
_COMPLETION_PARAM_NAMES = {"prompt_logprobs": "logprobs"}
_CHAT_PARAM_NAMES = {"logprobs": "top_logprobs", "prompt_logprobs": "top_logprobs"}


def parse_logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    bias: dict[int, float] = {}
    for key, value in (raw or {}).items():
        try:
            bias[int(key)] = float(value)
        except (TypeError, ValueError):
            raise ParamError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
    return bias


MAX_TEMPERATURE = 2.0  # OpenAI's range is 0 to 2 (the engine itself takes any temperature >= 0)


def to_sampling_params(
    req: _SamplingFields,
    *,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    seed: int | None = None,
    chat: bool = False,
    defaults: Mapping[str, Any] | None = None,
) -> SamplingParams:
    """The SamplingParams for one choice; ParamError (naming the request field) for an invalid value.

    ``defaults`` (the engine's generation defaults) fill the sampling fields the request leaves unset; past
    them, OpenAI's (temperature 1.0, no top-p/top-k/min-p filter, no repetition penalty)."""
    req.check_stops()
    if req.temperature is not None and req.temperature > MAX_TEMPERATURE:
        raise ParamError(
            f"temperature: {req.temperature:g} is greater than the maximum of {MAX_TEMPERATURE:g}",
            param="temperature",
        )
    d = for_request(dict(defaults or {}), req.temperature)
    structured, _ = req.structured()
    stop = req.stop
    if isinstance(stop, str):
        stop = [stop]
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=d.get("temperature", 1.0) if req.temperature is None else req.temperature,
            top_p=d.get("top_p", 1.0) if req.top_p is None else req.top_p,
            top_k=d.get("top_k", -1) if req.top_k is None else req.top_k,
            min_p=d.get("min_p", 0.0) if req.min_p is None else req.min_p,
            seed=seed,
            stop=list(stop or []),
            stop_token_ids=list(req.stop_token_ids or []),
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            ignore_eos=bool(req.ignore_eos),
            min_tokens=req.min_tokens or 0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=(
                d.get("repetition_penalty", 1.0) if req.repetition_penalty is None else req.repetition_penalty
            ),
            logit_bias=parse_logit_bias(req.logit_bias),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=True if req.skip_special_tokens is None else req.skip_special_tokens,
            structured_outputs=structured,
        )
    except BadRequestError as exc:  # SamplingParams names its own field; the request may call it otherwise
        field = exc.param
        param = field
        if field in SamplingParams.__dataclass_fields__:
            names = _CHAT_PARAM_NAMES if chat else _COMPLETION_PARAM_NAMES
            param = names.get(field, field)
            if chat and field == "max_tokens":
                param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"  # type: ignore[attr-defined]
        raise ParamError(exc.message, param=param) from None
