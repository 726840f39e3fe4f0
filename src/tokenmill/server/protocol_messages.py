"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) as pydantic models, and its
translation onto the chat path.

Strict as the OpenAI routes are: an unknown field, or a value asking for what tokenmill does not do (images,
extended thinking, server tools such as web search), is a 400 naming it, in Anthropic's error shape.
``cache_control`` marks are accepted on every block: they ask for prompt caching, which the prefix cache gives
every prompt (what it served is ``usage.cache_read_input_tokens``).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from tokenmill.server.protocol import (
    ChatCompletionRequest,
    ParamError,
    _Request,
    model_of_type,
    validate_tools,
    validation_error_to_param,
)

EFFORT_UNSUPPORTED = "This model does not support the effort parameter."


class TextBlock(_Request):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(_Request):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    caller: dict[str, Any] | None = None  # who made the call: only ever the model here
    toolset_name: None = None


class ToolResultBlock(_Request):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None
    toolset_name: None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or [])
        return f"Error: {body}" if self.is_error else body


class ThinkingBlock(_Request):
    """An earlier turn's thinking, as a reasoning model's answer gave it back (``thinking``, or Anthropic's
    ``redacted_thinking``): accepted in an assistant turn and not shown to the model again (thinking models'
    templates drop earlier turns' reasoning)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    cache_control: dict[str, Any] | None = None


_BLOCKS: dict[str, type[TextBlock] | type[ToolUseBlock] | type[ToolResultBlock] | type[ThinkingBlock]] = {
    "text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock, "thinking": ThinkingBlock,
    "redacted_thinking": ThinkingBlock,
}  # fmt: skip
Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


class MessageParam(_Request):
    role: Literal["user", "assistant", "system"]  # a system turn inside messages (Claude Code sends one)
    content: str | list[dict[str, Any]]

    def blocks(self, where: str) -> list[Block]:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        out: list[Block] = []
        for j, raw in enumerate(self.content):
            kind = raw.get("type")
            model = model_of_type(
                _BLOCKS,
                kind,
                f"{where}.content.{j}.type",
                "block",
                "text, tool_use, tool_result and thinking only",
            )
            if (
                model in (ToolUseBlock, ThinkingBlock)
                and self.role != "assistant"
                or model is ToolResultBlock
                and self.role != "user"
            ):
                raise ParamError(f"{where}.content.{j}: a {kind} block cannot be in a {self.role} message",
                                 param=f"{where}.content.{j}")  # fmt: skip
            try:
                out.append(model.model_validate(raw))
            except ValidationError as exc:
                inner = validation_error_to_param(exc)
                name = f"{where}.content.{j}.{inner.param}"
                raise ParamError(inner.message.replace(inner.param or "", name, 1), param=name) from None
        return out


class Tool(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # server tools (web_search_..., bash_...) run on Anthropic's side
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None  # as the chat route's function.strict
    input_examples: list[dict[str, Any]] | None = None  # shown to the model after the description
    eager_input_streaming: bool | None = None  # a streaming-granularity hint: calls stream whole here
    defer_loading: Literal[False] | None = None  # tool search is Anthropic's
    allowed_callers: None = None  # programmatic tool calling runs in Anthropic's code container

    def chat_tool(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        description = self.description or ""
        if self.input_examples:
            examples = "\n".join(json.dumps(e, ensure_ascii=False) for e in self.input_examples)
            description = f"{description}\nExample inputs:\n{examples}".strip()
        if description:
            function["description"] = description
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Request):
    """``disabled``, or ``adaptive`` (the model decides whether to think: this one never does); ``enabled``
    with a budget asks for extended thinking, which needs a model that thinks."""

    type: Literal["disabled", "adaptive"]
    # how thinking would be shown ("summarized", "omitted", Claude Code's "updates"): there is none to show here
    display: str | None = None


class OutputFormat(_Request):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Request):
    format: OutputFormat | None = (
        None  # structured outputs, through the same constraint path as the chat route
    )
    # effort levels are for models that think: refused as Anthropic refuses them for a model without the parameter
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class ClearThinkingEdit(_Request):
    """An edit that clears earlier turns' thinking blocks: a conversation here holds none (thinking blocks in
    ``messages`` are refused and the models served do not think), so any ``keep`` asks for nothing."""

    type: Literal["clear_thinking_20251015"]
    keep: Any = None


class ContextManagement(_Request):
    """Server-side context editing. Clearing thinking (Claude Code sends it on every request) is accepted;
    clearing old tool results (``clear_tool_uses_...``) would change the prompt and is not done here: 400."""

    edits: list[ClearThinkingEdit] | None = None


class _MessagesBase(_Request):
    model: str
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None  # every prompt's prefix is cached here
    context_management: ContextManagement | None = None

    def function_tools(self) -> list[Tool]:
        return validate_tools(
            self.tools, Tool, (None, "custom"),
            "client tools with input_schema only; server tools run on Anthropic's side", "tools.{i}",
        )  # fmt: skip

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages: the system prompt first; a user turn's tool results become
        tool messages (in order, before its text); an assistant turn's tool_use blocks its tool_calls."""
        if not self.messages:
            raise ParamError("messages: at least one message is required", param="messages")
        out: list[dict[str, Any]] = []
        if self.system:
            text = self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system)
            out.append({"role": "system", "content": text})
        for i, message in enumerate(self.messages):
            texts, calls = [], []
            for block in message.blocks(f"messages.{i}"):
                if isinstance(block, ThinkingBlock):
                    continue
                if isinstance(block, ToolResultBlock):
                    out.append({"role": "tool", "content": block.text(), "tool_call_id": block.tool_use_id})
                elif isinstance(block, ToolUseBlock):
                    calls.append({"id": block.id, "type": "function",
                                  "function": {"name": block.name, "arguments": json.dumps(block.input)}})  # fmt: skip
                else:
                    texts.append(block.text)
            if message.role == "system":  # a system turn in the conversation: its text as a system message
                out.append({"role": "system", "content": "".join(texts)})
                continue
            if texts or calls:
                entry: dict[str, Any] = {"role": message.role, "content": "".join(texts) if texts else None}
                if calls:
                    entry["tool_calls"] = calls
                if entry["content"] is None and message.role == "user":
                    entry["content"] = ""
                out.append(entry)
        return out

    def chat_body(self) -> dict[str, Any]:
        if self.output_config is not None and self.output_config.effort is not None:
            # Anthropic's words for a model without effort (clients' fallbacks resend without the field on them)
            raise ParamError(EFFORT_UNSUPPORTED, param="output_config.effort")
        tools = [t.chat_tool() for t in self.function_tools()]
        response_format = None
        if self.output_config is not None and self.output_config.format is not None:
            schema = self.output_config.format.schema_
            response_format = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
        choice = self.tool_choice
        tool_choice: Any = None
        parallel = None  # a forced call ("any", "tool") is one call; in "auto" the model may write several
        if choice is not None:
            tool_choice = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)
            if choice.type == "tool":
                if not choice.name:
                    raise ParamError(
                        'tool_choice.name is required with type "tool"', param="tool_choice.name"
                    )
                tool_choice = {"type": "function", "function": {"name": choice.name}}
            parallel = False if choice.disable_parallel_tool_use else None
        return {"messages": self.chat_messages(), "tools": tools or None, "tool_choice": tool_choice,
                "parallel_tool_calls": parallel, "response_format": response_format}  # fmt: skip


class CountTokensRequest(_MessagesBase):
    def to_chat(self) -> ChatCompletionRequest:
        return _validated(self.chat_body())


class MessagesRequest(_MessagesBase):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)  # Anthropic's range
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None  # user_id: a label for abuse detection on Anthropic's side
    service_tier: Literal["auto", "standard_only"] | None = None  # there is one tier here
    speed: Literal["standard"] | None = None  # there is one speed here
    user_profile_id: str | None = None  # labels of Anthropic's accounts
    workspace_id: str | None = None
    inference_geo: None = None  # a region: inference runs on this machine
    container: None = None  # code execution containers are Anthropic's
    diagnostics: None = None
    mcp_servers: None = None

    def to_chat(self) -> ChatCompletionRequest:
        if self.max_tokens < 1:
            raise ParamError(f"max_tokens: must be at least 1, got {self.max_tokens}", param="max_tokens")
        if self.metadata and set(self.metadata) - {"user_id"}:
            extra = sorted(set(self.metadata) - {"user_id"})[0]
            raise ParamError(f"metadata.{extra}: Extra inputs are not permitted", param=f"metadata.{extra}")
        body = self.chat_body()
        body.update(
            max_tokens=self.max_tokens, stop=self.stop_sequences, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k,
        )  # fmt: skip
        return _validated(body)


def _validated(body: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        inner = validation_error_to_param(exc)
        raise ParamError(f"messages: {inner.message}", param="messages") from None


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageObject(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: Usage
