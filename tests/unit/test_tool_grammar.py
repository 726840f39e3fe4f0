"""The forced-call grammar (``server/tool_calls.py``) and closed objects (``json_schema.py``) on the schemas
pydantic writes: nested models and enums under ``$defs``, optional fields (``anyOf`` with null), recursion
through ``#/$defs/...``, two tools that both define ``Item``. Each grammar is checked by llguidance itself
(compiled with the embedded model's tokenizer) and by feeding it a valid call token by token: the call must be
accepted and complete; an extra key, or a wrong enum value, must be refused.
"""

from __future__ import annotations

import enum
import json
from typing import Annotated, Literal

import llguidance
import pytest
from pydantic import BaseModel, Field

from tokenmill.json_schema import as_constraint, close_objects
from tokenmill.server.tool_calls import forced_call_grammar


class Kind(enum.StrEnum):
    A = "a"
    B = "b"


class Item(BaseModel):
    kind: Kind
    note: str | None = None


class Order(BaseModel):
    items: list[Item]
    gift: Item | None = None


class Tree(BaseModel):
    label: str
    children: list[Tree] = []


class Other(BaseModel):
    """A second tool whose schema also defines ``Item`` (another one)."""

    class Item(BaseModel):
        size: int

    item: Item


@pytest.fixture(scope="module")
def ll_tokenizer(embedded_tokenizer):
    tok = embedded_tokenizer
    return tok, llguidance.LLTokenizer(
        tok.to_json(), n_vocab=tok.vocab_size, eos_token=sorted(tok.eos_token_ids)
    )


def _tool(model: type[BaseModel]) -> dict:
    return {"type": "function", "function": {"name": model.__name__, "parameters": model.model_json_schema()}}


def _accepts(ll_tokenizer, grammar: str, text: str) -> bool:
    tok, ll = ll_tokenizer
    error = llguidance.LLMatcher.validate_grammar(grammar, ll)
    assert not error, error
    matcher = llguidance.LLMatcher(ll, grammar)
    for token in tok.encode(text, add_special_tokens=False):
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


def _call(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def test_nested_enum_optional_and_recursive_schemas_compile_and_accept(ll_tokenizer) -> None:
    for model in (Order, Tree):
        assert "$defs" in model.model_json_schema()
    order = {"items": [{"kind": "a", "note": None}, {"kind": "b"}], "gift": None}
    assert _accepts(ll_tokenizer, forced_call_grammar([_tool(Order)], "hermes", False), _call("Order", order))
    tree = {"label": "r", "children": [{"label": "x", "children": [{"label": "y", "children": []}]}]}
    assert _accepts(ll_tokenizer, forced_call_grammar([_tool(Tree)], "hermes", False), _call("Tree", tree))
    # llama3_json: the same schemas as {"name", "parameters"}
    g = forced_call_grammar([_tool(Tree)], "llama3_json", False)
    assert _accepts(ll_tokenizer, g, json.dumps({"name": "Tree", "parameters": tree}))


def test_refusals_inside_referenced_definitions(ll_tokenizer) -> None:
    g = forced_call_grammar([_tool(Order)], "hermes", False)
    assert not _accepts(ll_tokenizer, g, _call("Order", {"items": [{"kind": "c"}]}))  # not in the enum
    # an extra key inside a $defs model: closed (pydantic wrote no additionalProperties)
    assert not _accepts(ll_tokenizer, g, _call("Order", {"items": [{"kind": "a", "description": "x"}]}))


def test_two_tools_defining_the_same_name(ll_tokenizer) -> None:
    g = forced_call_grammar([_tool(Order), _tool(Other)], "hermes", False)
    assert _accepts(ll_tokenizer, g, _call("Other", {"item": {"size": 3}}))
    assert _accepts(ll_tokenizer, g, _call("Order", {"items": [{"kind": "b"}]}))
    assert not _accepts(ll_tokenizer, g, _call("Other", {"item": {"kind": "b"}}))  # Order's Item, not Other's


def test_a_tag_the_model_has_as_a_token_is_named_as_that_token() -> None:
    g = forced_call_grammar([_tool(Item)], "hermes", True, {"<tool_call>": 151657, "</tool_call>": 151658})
    assert '<[151657]> "\\n" call "\\n" <[151658]>' in g
    assert "start: block" in g and '("\\n" block)*' in g  # parallel calls
    plain = forced_call_grammar([_tool(Item)], "hermes", False)
    assert '"<tool_call>" "\\n" call "\\n" "</tool_call>"' in plain


def test_close_objects() -> None:
    schema = {
        "type": "object",
        "properties": {"type": {"type": "string"}, "inner": {"properties": {"x": {"type": "integer"}}}},
        "$defs": {
            "D": {"type": "object", "properties": {}},
            "Open": {"type": "object", "additionalProperties": True},
        },
        "anyOf": [{"type": ["object", "null"], "properties": {"y": {}}}, {"type": "object"}],
    }
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["inner"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["type"]  # a string, and a property named "type"
    assert closed["$defs"]["D"]["additionalProperties"] is False
    assert closed["$defs"]["Open"]["additionalProperties"] is True  # said so: kept
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in closed["anyOf"][1]  # any object: json_object's schema stays open
    assert "additionalProperties" not in schema  # the input is not changed
    bounded = as_constraint(schema)
    assert bounded["x-guidance"] == {"whitespace_pattern": "[\\n\\t ]{0,20}"}
    own = {**schema, "x-guidance": {"whitespace_flexible": False}}
    assert as_constraint(own)["x-guidance"] == {"whitespace_flexible": False}


def test_whitespace_runs_are_bounded(ll_tokenizer) -> None:
    """Qwen2.5-1.5B wrote spaces after a key until max_tokens: a run past MAX_WHITESPACE is refused."""
    from tokenmill.json_schema import MAX_WHITESPACE

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(as_constraint(schema))
    assert _accepts(ll_tokenizer, grammar, '{\n  "a": 1\n}')
    assert not _accepts(ll_tokenizer, grammar, '{"a":' + " " * (MAX_WHITESPACE + 5) + "1}")


def test_a_whole_answer_that_is_one_fenced_or_bare_call_is_a_call() -> None:
    """Qwen2.5-Coder, offered tools, often answers with the call in a code fence instead of the tags."""
    from tokenmill.server.tool_calls import parse, streamable_prefix

    names = {"get_weather"}
    fenced = '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris"}\n}\n```'
    content, (call,) = parse(fenced, "hermes", names)
    assert content is None and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    content, (call,) = parse('{"name": "get_weather", "arguments": {"city": "Rome"}}', "hermes", names)
    assert json.loads(call.arguments) == {"city": "Rome"}
    # not a call: text around the fence, an unknown function, a fence of other JSON
    for text in (f"Here it is: {fenced}", fenced.replace("get_weather", "other"), '```json\n{"a": 1}\n```'):
        assert parse(text, "hermes", names) == (text, [])
    # streaming holds what could be such an answer, and nothing else
    assert streamable_prefix("``", "hermes") == 0 and streamable_prefix('{"na', "hermes") == 0
    assert streamable_prefix("Sunny ``", "hermes") == 8


class Cat(BaseModel):
    pet: Literal["cat"]
    lives: int


class Dog(BaseModel):
    pet: Literal["dog"]
    good: bool


class Owner(BaseModel):
    """A discriminated union: pydantic writes oneOf with a discriminator over $defs refs."""

    animal: Annotated[Cat | Dog, Field(discriminator="pet")]


def test_a_discriminated_union(ll_tokenizer) -> None:
    assert "oneOf" in json.dumps(Owner.model_json_schema())
    g = forced_call_grammar([_tool(Owner)], "hermes", False)
    assert _accepts(ll_tokenizer, g, _call("Owner", {"animal": {"pet": "dog", "good": True}}))
    assert not _accepts(ll_tokenizer, g, _call("Owner", {"animal": {"pet": "dog", "lives": 9}}))
