"""OpenAI tool calling over a model that writes calls as text: the tools into the prompt, the grammar that
forces a call, and the parser that turns the model's text back into ``message.tool_calls``.

Formats (``--tool-call-parser``, vLLM's names):

- ``hermes`` (Hermes, Qwen; the default, and what the fallback prompt teaches the embedded model)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- ``llama3_json`` (Llama 3.1): the whole answer is ``{"name": ..., "parameters": {...}}`` (an optional
  ``<|python_tag|>`` first).

The tools reach the prompt through the chat template when it renders them (its source mentions ``tools``;
Hugging Face templates take ``tools=``). Otherwise (SmolLM2's template) a system message, written below,
lists them with the format to answer in; it goes first, merged into the request's own system message.
``tool_choice="required"`` or a named function is enforced with a Lark grammar whose call is llguidance's
``%json`` of the function's parameter schema, so the arguments always parse and validate; ``"auto"`` leaves
the model free and parses whatever calls it wrote; ``"none"`` sends no tools at all.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenmill.json_schema import as_constraint

PARSERS = ("hermes", "llama3_json")
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# A whole answer that is one JSON call in a code fence, or bare: Qwen2.5-Coder, offered tools by its own
# template, often answers ```json {"name": ..., "arguments": ...}``` instead of using the tags (llama.cpp's
# Hermes parser takes fenced calls too). Only an answer that is nothing else, naming an offered function.
_FENCED_CALL = re.compile(r"```(?:json)?\s*(\{.*\})\s*```", re.DOTALL)


@dataclass
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's shape)
    id: str


def fallback_system_prompt(tools: list[dict[str, Any]], parser: str) -> str:
    """Tools for a template that cannot render them, in the words and format the parser reads."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    if parser == "llama3_json":
        fmt = 'answer with only a JSON object {"name": <function name>, "parameters": <arguments object>}'
    else:
        fmt = (
            "return each call inside <tool_call></tool_call> tags as a JSON object "
            '{"name": <function name>, "arguments": <arguments object>}'
        )
    return (
        "You may call one or more functions to answer the user. The functions are listed in <tools></tools>:\n"
        f"<tools>\n{listing}\n</tools>\nTo call a function, {fmt}. Otherwise answer in plain text."
    )


def render_call(name: str, arguments: str, parser: str) -> str:
    """An assistant turn's earlier call, written back into the history in the model's format."""
    args = parse_arguments(arguments) if arguments else {}
    if parser == "llama3_json":
        return json.dumps({"name": name, "parameters": args}, ensure_ascii=False)
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n</tool_call>"


def parse_arguments(arguments: str) -> Any:
    """A call's ``arguments`` (a JSON text) parsed; ValueError saying why for text that is not JSON, nests
    too deeply, or holds a lone surrogate (which no encoder downstream can write)."""
    try:
        args = json.loads(arguments)
        json.dumps(args, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise ValueError("they nest too deeply") from None
    except UnicodeEncodeError:
        raise ValueError("they hold text that is not valid Unicode (a lone surrogate)") from None
    except ValueError as exc:
        raise ValueError(f"they are not valid JSON: {exc}") from None
    return args


_DEFS_KEYS = ("$defs", "definitions")


def _rebase_refs(node: Any, params_at: str, defs_prefix: str) -> Any:
    """``node`` with every local ``$ref`` rewritten for a schema moved to ``params_at`` (a JSON pointer) in a
    document whose root holds its definitions as ``$defs/<defs_prefix><name>``: pydantic writes nested models
    and enums as ``#/$defs/Name`` and a recursive model as ``#``, both relative to the parameters' root."""
    if isinstance(node, list):
        return [_rebase_refs(v, params_at, defs_prefix) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            pointer = value[1:]
            for defs in _DEFS_KEYS:
                if pointer.startswith(f"/{defs}/"):
                    value = f"#/$defs/{defs_prefix}{pointer[len(defs) + 2 :]}"
                    break
            else:
                value = f"#{params_at}{pointer}"
            out[key] = value
        else:
            out[key] = _rebase_refs(value, params_at, defs_prefix)
    return out


def _call_schema(tool: dict[str, Any], parser: str, params_at: str, defs_prefix: str) -> dict[str, Any]:
    """The JSON schema of one call of ``tool``; its parameters' definitions are hoisted to the document root
    (``_rebase_refs``), where the references resolve once the parameters sit under ``properties.<key>``."""
    fn = tool["function"]
    params = dict(fn.get("parameters") or {"type": "object", "properties": {}})
    key = "parameters" if parser == "llama3_json" else "arguments"
    defs: dict[str, Any] = {}
    for defs_key in _DEFS_KEYS:
        for name, sub_schema in (params.pop(defs_key, None) or {}).items():
            defs[f"{defs_prefix}{name}"] = sub_schema
    at = f"{params_at}/properties/{key}"
    schema = {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, key: _rebase_refs(params, at, defs_prefix)},
        "required": ["name", key],
        "additionalProperties": False,
    }
    if defs:
        schema["$defs"] = {n: _rebase_refs(s, at, defs_prefix) for n, s in defs.items()}
    return schema


HERMES_TAGS = ("<tool_call>", "</tool_call>")


def _literal(text: str, token_ids: Mapping[str, int]) -> str:
    """``text`` in a grammar: the token that is exactly it when the model has one (``<[id]>``), else a string."""
    token_id = token_ids.get(text)
    return f"<[{token_id}]>" if token_id is not None else json.dumps(text)


def forced_call_grammar(
    tools: list[dict[str, Any]], parser: str, parallel: bool, token_ids: Mapping[str, int] | None = None
) -> str:
    """A Lark grammar (llguidance's dialect) whose every sentence is one call (or several, ``parallel``) of
    one of ``tools``, the arguments valid for that function's JSON schema.

    ``token_ids`` maps a tag to the model's own token for it (``Tokenizer.added_token_id``): Qwen2.5 has
    ``<tool_call>`` as token 151657 and writes it so, and the grammar must then name that token, not the text.
    The schema's ``$defs`` move to the root of the call's schema, so the ``$ref``s of a pydantic model resolve;
    objects that do not say ``additionalProperties`` are closed (``tokenmill.json_schema``).
    """
    if len(tools) == 1:
        schema = _call_schema(tools[0], parser, "", "")
    else:  # each tool's definitions under its own prefix: two pydantic models may both define "Item"
        schemas = [_call_schema(t, parser, f"/anyOf/{i}", f"tool{i}_") for i, t in enumerate(tools)]
        defs = {n: s for sch in schemas for n, s in sch.pop("$defs", {}).items()}
        schema = {"anyOf": schemas, **({"$defs": defs} if defs else {})}
    body = json.dumps(as_constraint(schema))
    if parser == "llama3_json":
        return f"start: call\ncall: %json {body}\n"
    opening, closing = (_literal(tag, token_ids or {}) for tag in HERMES_TAGS)
    block = f'block: {opening} "\\n" call "\\n" {closing}'
    start = 'start: block ("\\n" block)*' if parallel else "start: block"
    return f"{start}\n{block}\ncall: %json {body}\n"


def streamable_prefix(text: str, parser: str) -> int:
    """How much of a partial answer can stream as content: all of it up to where a call starts or could
    be starting (a tail that is a prefix of the opening tag). Answers that open with ``{`` (and, for hermes,
    a code fence) or the python tag are held whole: they may be one call."""
    if parser == "llama3_json":
        head = text.lstrip()
        if head.startswith("{") or head.startswith("<|python_tag|>") or "<|python_tag|>".startswith(head):
            return 0
        return len(text)
    head = text.lstrip()
    if head.startswith(("{", "```")) or (head and "```".startswith(head)):  # could be a whole-answer call
        return 0
    opening = "<tool_call>"
    at = text.find(opening)
    if at >= 0:
        return at
    for keep in range(min(len(opening) - 1, len(text)), 0, -1):
        if text.endswith(opening[:keep]):
            return len(text) - keep
    return len(text)


def parse(text: str, parser: str, tool_names: set[str]) -> tuple[str | None, list[ParsedCall]]:
    """(content left outside the calls or None, the calls); text that names no known function stays text."""
    calls: list[ParsedCall] = []
    if parser == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        call = _decode(body, "parameters", tool_names)
        return (None, [call]) if call is not None else (text, [])
    rest = text
    for match in _HERMES_CALL.finditer(text):
        call = _decode(match.group(1), "arguments", tool_names)
        if call is not None:
            calls.append(call)
            rest = rest.replace(match.group(0), "", 1)
    if not calls:
        whole = text.strip()
        fenced = _FENCED_CALL.fullmatch(whole)
        body = fenced.group(1) if fenced else whole if whole.startswith("{") else None
        call = _decode(body, "arguments", tool_names) if body is not None else None
        return (None, [call]) if call is not None else (text, [])
    content = rest.strip()
    return (content or None), calls


def _decode(body: str, key: str, tool_names: set[str]) -> ParsedCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in tool_names:
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if not isinstance(args, dict):
        return None
    return ParsedCall(
        name=obj["name"], arguments=json.dumps(args, ensure_ascii=False), id=f"call_{uuid.uuid4().hex[:24]}"
    )
