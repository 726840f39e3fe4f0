"""OpenAI's Responses API (``POST /v1/responses``) as pydantic models, and its translation onto the chat path.

A request is strict as the chat one is: an unknown field is a 400 naming it, and so is a known field whose value
asks for something tokenmill does not do (a built-in tool such as ``web_search``, ``reasoning.effort`` on a model
that does not reason, an ``include`` value it cannot produce, ``background: true``, ``truncation: "auto"``).
``to_chat`` turns the request (with the conversation of ``previous_response_id`` before its input) into a
:class:`~tokenmill.server.protocol.ChatCompletionRequest`, so templates, tools, constraints and sampling are
decided in one place (``routes_chat.plan_chat``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool, ValidationError, field_validator

from tokenmill.server.protocol import (
    ChatCompletionRequest,
    ParamError,
    _Request,
    model_of_type,
    validate_tools,
    validation_error_to_param,
)

# include values tokenmill can produce (the output text's logprobs); the others name outputs of built-in tools,
# reasoning it does not have, or images.
SUPPORTED_INCLUDE = frozenset({"message.output_text.logprobs", "reasoning.encrypted_content"})
# "reasoning.encrypted_content" asks for the encrypted text of the reasoning items in the output, of which these
# models make none: it asks for nothing (Codex CLI sends it with every request)


# --- input items ------------------------------------------------------------------------------------


class InputText(_Request):
    type: Literal["input_text"]
    text: str


class OutputText(_Request):
    """An assistant's earlier text, as the SDKs send back the output items they received."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


class Refusal(_Request):
    type: Literal["refusal"]
    refusal: str


class _Item(_Request):
    # the client's own labels of an item (Codex CLI's turn id and creation time): ask for nothing
    internal_chat_message_metadata_passthrough: dict[str, Any] | None = None


class MessageItem(_Item):
    type: Literal["message"] | None = None
    id: str | None = None
    status: str | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText | OutputText | Refusal]
    # an output message's label, as the SDK's model_dump() of it sends it back: asks for nothing
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in self.content)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    id: str | None = None
    status: str | None = None
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None  # a namespace tool's function (the model knew it as <namespace>__<name>)

    def qualified_name(self) -> str:
        return self.name if self.namespace is None else f"{self.namespace}__{self.name}"


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    id: str | None = None
    status: str | None = None
    call_id: str
    output: str | list[InputText]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(_Item):
    """An earlier turn's thinking, as a reasoning model's response gave it back: accepted and not shown to the
    model again (thinking models' templates drop earlier turns' reasoning)."""

    type: Literal["reasoning"]
    id: str | None = None
    status: str | None = None
    summary: list[dict[str, Any]] | None = None
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEM_TYPES: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}
_CONTENT_TYPES = ("input_text", "output_text", "refusal")


def parse_items(raw: list[Any], param: str = "input") -> list[InputItem]:
    """Each input item validated, with a 400 naming the item (``input[2].call_id``) for a bad one."""
    items: list[InputItem] = []
    for i, item in enumerate(raw):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise ParamError(f"{where} must be an object", param=where)
        model = model_of_type(
            _ITEM_TYPES, item.get("type", "message"), f"{where}.type", "item",
            "tokenmill takes messages, function_call function_call_output and reasoning items",
        )  # fmt: skip
        if model is MessageItem and isinstance(item.get("content"), list):
            for j, part in enumerate(item["content"]):
                ptype = part.get("type") if isinstance(part, dict) else None
                if ptype not in _CONTENT_TYPES:
                    raise ParamError(
                        f"{where}.content[{j}].type: content type {ptype!r} is not supported (text only)",
                        param=f"{where}.content[{j}].type",
                    )
        try:
            items.append(model.model_validate(item))
        except ValidationError as exc:
            inner = validation_error_to_param(exc)
            name = f"{where}.{inner.param}" if inner.param else where
            raise ParamError(inner.message.replace(inner.param or "", name, 1), param=name) from None
    return items


# --- the request --------------------------------------------------------------------------------------


class FunctionTool(_Request):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceTool(_Request):
    """Function tools grouped under a name (Codex CLI's MCP servers): offered to the model as functions named
    ``<namespace>__<name>``, and a call to one comes back as a ``function_call`` with ``name`` and ``namespace``."""

    type: Literal["namespace"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    tools: list[dict[str, Any]]


NAMESPACE_SEPARATOR = "__"


@dataclass
class OfferedTools:
    """A request's tools as the model sees them: function tools (a namespace's under qualified names), which
    qualified name is which namespace's function, and the built-in tools dropped (optional under tool_choice)."""

    functions: list[FunctionTool] = field(default_factory=list)
    namespaces: dict[str, tuple[str, str]] = field(
        default_factory=dict
    )  # qualified name -> (namespace, name)
    dropped: list[str] = field(default_factory=list)


class NamedFunctionChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the one verbosity a model without the setting has


class Reasoning(_Request):
    """Only what asks for no reasoning: a null or "none" effort (any other asks for reasoning these models do
    not do). A summary is of the reasoning done, of which there is none: any value asks for nothing."""

    effort: Literal["none"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(_Request):
    include_obfuscation: bool | None = None  # padding against length side channels: tokenmill sends none


MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's bounds


def check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's bounds on ``metadata``: 16 pairs, keys of 64 characters, values of 512; ParamError past them."""
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise ParamError(
            f"metadata: at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}", param="metadata"
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise ParamError(
                f"metadata: keys are at most {MAX_METADATA_KEY_CHARS} characters", param="metadata"
            )
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise ParamError(
                f"metadata.{key}: values are at most {MAX_METADATA_VALUE_CHARS} characters",
                param=f"metadata.{key}",
            )


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = True
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    client_metadata: dict[str, Any] | None = (
        None  # the client's own labels (Codex CLI's turn and session ids)
    )
    # Labels and hints that ask for nothing tokenmill would have to do: who the end user is, a key for
    # routing to a warm cache (every prefix is cached here), the one service tier there is, no truncation.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: Reasoning | None = None
    background: StrictBool | None = None  # only false (0 is not false)
    # false: prefill only, to warm the prefix cache for the next turn (the WebSocket mode's warm-up; Codex CLI
    # sends one at start): a response with no output
    generate: StrictBool | None = None
    max_tool_calls: None = None  # a cap on built-in tool calls: there are none here
    prompt: None = None  # stored prompt templates live on OpenAI's side
    conversation: None = None  # the Conversations API is not served
    # vLLM's extras
    top_k: int | None = None
    seed: int | None = None
    cache_salt: str | None = None

    @field_validator("background")
    @classmethod
    def _foreground_only(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("Input should be False (background responses are not served)")
        return value

    def function_tools(self) -> list[FunctionTool]:
        return self.offered_tools().functions

    def offered_tools(self) -> OfferedTools:
        """Function and namespace tools as functions; a built-in tool (``web_search`` and the like, run on OpenAI's
        side) is dropped where the model may answer without it (``tool_choice`` not ``"required"``, or other tools
        offered), else refused naming it."""
        out = OfferedTools()
        hosted = []
        for i, raw in enumerate(self.tools or []):
            kind = raw.get("type") if isinstance(raw, dict) else None
            where = f"tools[{i}]"
            if kind == "function":
                out.functions += validate_tools([raw], FunctionTool, ("function",), "", where)
            elif kind == "namespace":
                (space,) = validate_tools([raw], NamespaceTool, ("namespace",), "", where)
                refusal = "a namespace holds function tools"
                for fn in validate_tools(
                    space.tools, FunctionTool, ("function",), refusal, where + ".tools[{i}]"
                ):
                    qualified = f"{space.name}{NAMESPACE_SEPARATOR}{fn.name}"
                    out.namespaces[qualified] = (space.name, fn.name)
                    out.functions.append(fn.model_copy(update={"name": qualified}))
            else:
                hosted.append((where, kind))
        for where, kind in hosted:
            if self.tool_choice == "required" and not out.functions:
                raise ParamError(
                    f"{where}.type: tool type {kind!r} is not supported (tokenmill runs function tools only; "
                    "built-in tools such as web_search are OpenAI's)", param=f"{where}.type",
                )  # fmt: skip
            out.dropped.append(str(kind))
        return out

    def check(self) -> None:
        """What the pydantic fields cannot say; ParamError naming the field."""
        for value in self.include or []:
            if value not in SUPPORTED_INCLUDE:
                raise ParamError(
                    f"include: {value!r} is not supported (tokenmill can include: {', '.join(sorted(SUPPORTED_INCLUDE))})",
                    param="include",
                )
        if self.top_logprobs and "message.output_text.logprobs" not in (self.include or []):
            raise ParamError(
                'top_logprobs needs include: ["message.output_text.logprobs"]', param="top_logprobs"
            )
        if self.input is None and self.previous_response_id is None:
            raise ParamError("input is required", param="input")
        check_metadata(self.metadata)

        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ParamError(
                f"max_output_tokens must be at least 1, got {self.max_output_tokens}",
                param="max_output_tokens",
            )

    @property
    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or [])

    def input_items(self) -> list[InputItem]:
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return parse_items(self.input)


def items_to_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive function calls join the assistant turn before them, and each
    call's output is a tool message answering it."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, ReasoningItem):
            continue
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.qualified_name(), "arguments": item.arguments}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "content": item.text(), "tool_call_id": item.call_id})
    return messages


def to_chat(req: ResponsesRequest, history: list[InputItem]) -> ChatCompletionRequest:
    """The chat request this Responses request stands for: ``instructions`` as the system message, then the
    stored conversation (``history``), then the request's own input."""
    messages = items_to_messages(history + req.input_items())
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    if not messages:
        raise ParamError("input produced no messages", param="input")
    tools = [
        {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
        for t in req.function_tools()
    ]
    tool_choice: Any = req.tool_choice
    if isinstance(tool_choice, NamedFunctionChoice):
        tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
    response_format = None
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        response_format = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise ParamError("text.format.schema is required for json_schema", param="text.format.schema")
        response_format = {
            "type": "json_schema",
            "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_},
        }
    body: dict[str, Any] = {
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "seed": req.seed,
        "tools": tools or None,
        "tool_choice": tool_choice,
        # as the chat route reads it: a forced call is one call unless parallel calls are asked for outright
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": response_format,
        "logprobs": req.wants_logprobs,
        "top_logprobs": req.top_logprobs,
        "cache_salt": req.cache_salt,
    }
    try:
        return ChatCompletionRequest.model_validate(body)
    except (
        ValidationError
    ) as exc:  # a value the chat request refuses (an empty content it cannot template...)
        inner = validation_error_to_param(exc)
        raise ParamError(f"input: {inner.message}", param="input") from None


# --- the response -------------------------------------------------------------------------------------


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[dict[str, Any]]
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool
    temperature: float | None = None
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]
    top_p: float | None = None
    top_logprobs: int | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    background: bool = False
    service_tier: str = "default"
