"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/embed``...) as pydantic models, and its translation onto
the chat and completions paths.

Strict as the other routes: an unknown field, or an option tokenmill does not honour, is a 400 naming it
(``options.mirostat``); ``images`` are refused (the models served read text). ``options`` map onto sampling:
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repeat_penalty``, ``seed``, ``num_predict`` (-1: until the
context ends), ``stop``, ``num_ctx`` (at most the served context; the prompt and its answer must fit it).
``format`` is ``"json"`` or a JSON schema, through the structured-outputs path. ``keep_alive`` is accepted: the
model stays loaded for as long as the server runs.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from tokenmill.server.protocol import ChatCompletionRequest, ParamError, _Request

# Ollama's options and the sampling field each becomes
_OPTION_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repeat_penalty": "repetition_penalty", "seed": "seed", "stop": "stop",
}  # fmt: skip
_OPTIONS = (*_OPTION_FIELDS, "num_predict", "num_ctx")


class ToolCallFunction(_Request):
    name: str
    arguments: dict[str, Any]
    index: int | None = None


class ToolCall(_Request):
    function: ToolCallFunction
    id: str | None = None


class Message(_Request):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: None = None  # the models served read text
    tool_calls: list[ToolCall] | None = None
    thinking: str | None = None  # an earlier answer's thinking: left out of the prompt
    tool_name: str | None = None  # a tool message's function
    tool_call_id: str | None = None


class _Generating(_Request):
    model: str
    format: Literal["json"] | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: str | int | float | None = None  # the model stays loaded while the server runs
    think: bool | None = None

    def sampling_fields(self, max_model_len: int) -> dict[str, Any]:
        """Chat-request fields for ``options`` and ``format``; ParamError naming an option not honoured."""
        options = self.options or {}
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise ParamError(
                f"options.{unknown[0]}: not supported (tokenmill honours {', '.join(_OPTIONS)})",
                param=f"options.{unknown[0]}",
            )
        fields = {_OPTION_FIELDS[k]: v for k, v in options.items() if k in _OPTION_FIELDS and v is not None}
        if isinstance(fields.get("stop"), str):
            fields["stop"] = [fields["stop"]]
        num_predict = options.get("num_predict")
        if num_predict is not None and num_predict not in (-1, -2):
            fields["max_tokens"] = num_predict
        num_ctx = options.get("num_ctx")
        if num_ctx is not None and (not isinstance(num_ctx, int) or not 0 < num_ctx <= max_model_len):
            raise ParamError(
                f"options.num_ctx: must be 1 to the served context ({max_model_len}), got {num_ctx!r}",
                param="options.num_ctx",
            )
        if self.format == "json":
            fields["response_format"] = {"type": "json_object"}
        elif self.format is not None:
            fields["response_format"] = {
                "type": "json_schema", "json_schema": {"name": "format", "schema": self.format},
            }  # fmt: skip
        return fields


class ChatRequest(_Generating):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    def to_chat(self, max_model_len: int) -> ChatCompletionRequest:
        messages = []
        for i, m in enumerate(self.messages):
            entry: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.tool_calls:
                entry["tool_calls"] = [
                    {"id": c.id or f"call_{i}_{j}", "type": "function",
                     "function": {"name": c.function.name, "arguments": json.dumps(c.function.arguments)}}
                    for j, c in enumerate(m.tool_calls)
                ]  # fmt: skip
                entry["content"] = m.content or None
            if m.role == "tool":
                entry["tool_call_id"] = m.tool_call_id or _answered_call(self.messages, i)
            messages.append(entry)
        body = {"model": self.model, "messages": messages, "tools": self.tools or None,
                **self.sampling_fields(max_model_len)}  # fmt: skip
        return _validated(body)


class GenerateRequest(_Generating):
    prompt: str = ""
    suffix: None = None  # fill-in-the-middle needs a model template that has it
    images: None = None
    system: str | None = None
    template: None = None  # the model's own template only
    raw: bool = False
    context: None = None  # the older continuation by token ids: send the text instead

    def to_chat(self, max_model_len: int) -> ChatCompletionRequest:
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": self.prompt})
        return _validated({"model": self.model, "messages": messages, **self.sampling_fields(max_model_len)})


class EmbedRequest(_Request):
    model: str
    input: str | list[str]
    truncate: bool = True
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None
    dimensions: int | None = None


class EmbeddingsRequest(_Request):
    """The older ``/api/embeddings``: one ``prompt``, one ``embedding``."""

    model: str
    prompt: str
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


class ShowRequest(_Request):
    model: str | None = None
    name: str | None = None  # the older field
    verbose: bool | None = None


def _answered_call(messages: list[Message], index: int) -> str:
    """A tool message without an id answers the earlier call of its ``tool_name`` (Ollama's clients send names)."""
    name = messages[index].tool_name
    for i in range(index - 1, -1, -1):
        for j, call in enumerate(messages[i].tool_calls or []):
            if name is None or call.function.name == name:
                return call.id or f"call_{i}_{j}"
    raise ParamError(
        f"messages[{index}]: a tool message answers no earlier tool call", param=f"messages[{index}]"
    )


def _validated(body: dict[str, Any]) -> ChatCompletionRequest:
    from pydantic import ValidationError

    from tokenmill.server.protocol import validation_error_to_param

    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error_to_param(exc) from None
