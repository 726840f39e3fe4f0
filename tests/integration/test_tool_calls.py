"""Tool calling through the server with the official openai SDK: forced calls (required, named) whose
arguments validate against the schema, streamed and not, auto, and a round trip with a tool result."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from serverproc import ServerProcess

from tokenmill.server.tool_calls import forced_call_grammar, parse

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    proc = ServerProcess("--max-model-len", "1024").start()
    yield openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    proc.stop()


def _valid_weather_args(arguments: str) -> None:
    args = json.loads(arguments)
    assert (
        set(args) == {"city", "unit"}
        and isinstance(args["city"], str)
        and args["unit"] in ("celsius", "fahrenheit")
    )


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_call_validates_streamed_and_not(client: openai.OpenAI, choice: Any) -> None:
    model = client.models.list().data[0].id
    tools = [WEATHER] if choice == "required" else [WEATHER, TIME]
    got = client.chat.completions.create(
        model=model, messages=ASK, tools=tools, tool_choice=choice, max_tokens=120, temperature=0
    )
    c = got.choices[0]
    assert c.finish_reason == "tool_calls"
    (call,) = c.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    _valid_weather_args(call.function.arguments)
    stream = client.chat.completions.create(
        model=model, messages=ASK, tools=tools, tool_choice=choice, max_tokens=120, temperature=0, stream=True
    )
    name, arguments, finish = "", "", None
    for chunk in stream:
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                assert tc.index == 0
                name += tc.function.name or ""
                arguments += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and name == "get_weather"
    assert json.loads(arguments) == json.loads(call.function.arguments)  # the same call, streamed


def test_round_trip_with_a_tool_result(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    first = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=120, temperature=0
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]  # fmt: skip
    answer = client.chat.completions.create(
        model=model, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=40, temperature=0
    )
    msg = answer.choices[0].message
    assert msg.tool_calls is None and msg.content


def test_auto_and_bad_tool_requests(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    auto = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], max_tokens=60, temperature=0
    )
    c = auto.choices[0]
    if c.message.tool_calls:  # the model chose a call: then it is well formed
        assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "get_weather"
    else:
        assert c.finish_reason in ("stop", "length") and c.message.content
    bad = [
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools.0.function.name"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
    ]
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, messages=ASK, max_tokens=5, **extra)
        assert info.value.body["param"] == param, (extra, info.value.body)


def test_parsers_and_grammar_offline() -> None:
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    content, calls = parse(text, "hermes", {"get_weather"})
    assert (
        content == "Sure."
        and calls[0].name == "get_weather"
        and json.loads(calls[0].arguments)["city"] == "Oslo"
    )
    assert parse(text, "hermes", {"other"}) == (text, [])  # an unknown function stays text
    content, calls = parse(
        '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}', "llama3_json", {"get_time"}
    )
    assert content is None and json.loads(calls[0].arguments) == {"zone": "UTC"}
    assert "%json" in forced_call_grammar([WEATHER], "llama3_json", False)


def test_streamable_prefix_holds_back_a_possible_call() -> None:
    from tokenmill.server.tool_calls import streamable_prefix

    assert streamable_prefix("Hello there", "hermes") == 11
    assert streamable_prefix("Hello <tool", "hermes") == 6  # could be a call starting
    assert streamable_prefix("Hi <tool_call>{", "hermes") == 3
    assert streamable_prefix("Hi <b>", "hermes") == 6
    assert streamable_prefix('{"name"', "llama3_json") == 0 and streamable_prefix("Sure", "llama3_json") == 4


def test_auto_text_answer_streams_the_same_text(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    ask = [{"role": "user", "content": "Say hello to me in one short sentence."}]
    whole = client.chat.completions.create(
        model=model, messages=ask, tools=[WEATHER], max_tokens=30, temperature=0
    ).choices[0]
    stream = client.chat.completions.create(
        model=model, messages=ask, tools=[WEATHER], max_tokens=30, temperature=0, stream=True
    )
    pieces, calls = [], []
    for chunk in stream:
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
            calls.extend(ch.delta.tool_calls or [])
    if whole.message.tool_calls:
        assert calls and calls[0].function.name == whole.message.tool_calls[0].function.name
    else:
        assert "".join(pieces) == whole.message.content and len([p for p in pieces if p]) > 1  # streamed
