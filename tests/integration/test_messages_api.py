"""Anthropic's Messages API against a real server, through the ``anthropic`` SDK (its typed models and stream
accumulator are the reference for the wire format): the embedded model in the default run, the 1.5B slow."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import pytest
from serverproc import ServerProcess, model_server

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-test-key"
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(None, id="smollm2-135m"),
        pytest.param("qwen2.5-coder-1.5b-instruct", id="qwen2.5-1.5b", marks=pytest.mark.slow),
    ],
)
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    proc = model_server(
        request.param,
        "--max-model-len",
        "2048",
        "--num-kv-blocks",
        "512",
        "--api-key",
        KEY,
        "--log-level",
        "info",
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def served(server: ServerProcess) -> str:
    return str(server.model_name)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0)  # sends x-api-key


def test_create_and_usage(client: anthropic.Anthropic, served: str, server: ServerProcess) -> None:
    m = client.messages.create(
        model=served, max_tokens=24, system="Be brief.", messages=[{"role": "user", "content": "Say hello."}],
        extra_body={"temperature": 0},
    )  # fmt: skip
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens")
    if m.stop_reason == "max_tokens":
        assert m.usage.output_tokens == 24
    # the same prompt through the chat route, greedy: the same text
    chat = httpx.post(
        f"{server.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
        json={"max_tokens": 24, "temperature": 0, "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]},
    ).json()  # fmt: skip
    assert chat["choices"][0]["message"]["content"] == m.content[0].text
    again = client.messages.create(
        model=served, max_tokens=4, system="Be brief.", messages=[{"role": "user", "content": "Say hello."}]
    )
    # Anthropic's usage: input_tokens are the ones not read from the cache
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == m.usage.input_tokens


def test_stop_sequences(client: anthropic.Anthropic, served: str) -> None:
    free = client.messages.create(
        model=served, max_tokens=30, messages=[{"role": "user", "content": "Count from 1 to 9."}],
        extra_body={"temperature": 0},
    )  # fmt: skip
    text = free.content[0].text  # type: ignore[union-attr]
    word = text.split()[1] if len(text.split()) > 2 else None
    if word is None:
        pytest.skip("the model wrote too little to pick a stop sequence from")
    m = client.messages.create(
        model=served, max_tokens=30, messages=[{"role": "user", "content": "Count from 1 to 9."}],
        stop_sequences=[word], extra_body={"temperature": 0},
    )  # fmt: skip
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert word not in m.content[0].text  # type: ignore[union-attr]


def test_stream_matches_the_event_sequence(
    client: anthropic.Anthropic, served: str, server: ServerProcess
) -> None:
    with client.messages.stream(
        model=served, max_tokens=20, messages=[{"role": "user", "content": "Count to three."}]
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].type == "text" and final.usage.output_tokens > 0
    raw = []
    with httpx.stream(
        "POST", f"{server.base_url}/v1/messages", headers={"x-api-key": KEY}, timeout=60,
        json={"model": served, "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "Hi"}]},
    ) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("event: "):
                raw.append(line.removeprefix("event: "))
    assert raw[:3] == ["message_start", "ping", "content_block_start"]
    assert set(raw[3:-3]) <= {"content_block_delta"}
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_tool_round_trip(client: anthropic.Anthropic, served: str) -> None:
    m = client.messages.create(
        model=served, max_tokens=80, tools=[WEATHER], tool_choice={"type": "any"},  # type: ignore[list-item]
        messages=[{"role": "user", "content": "What is the weather in Rome?"}],
    )  # fmt: skip
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1
    assert uses[0].name == "get_weather" and isinstance(uses[0].input["city"], str)  # type: ignore[index]
    follow = client.messages.create(
        model=served, max_tokens=20, tools=[WEATHER],  # type: ignore[list-item]
        messages=[
            {"role": "user", "content": "What is the weather in Rome?"},
            {"role": "assistant", "content": m.content},  # type: ignore[typeddict-item]
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny"}]},
        ],
    )  # fmt: skip
    assert follow.content and follow.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with client.messages.stream(
        model=served, max_tokens=80, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},  # type: ignore[list-item]
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    ) as stream:  # fmt: skip
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds  # the SDK's event for an input_json_delta
    tool = [b for b in final.content if b.type == "tool_use"]
    assert tool and tool[0].input["city"]  # type: ignore[index]
    assert final.stop_reason == "tool_use"


def test_count_tokens(client: anthropic.Anthropic, served: str, server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    counted = client.messages.count_tokens(model=served, messages=messages, system="Be brief.")  # type: ignore[arg-type]
    m = client.messages.create(model=served, max_tokens=1, messages=messages, system="Be brief.")  # type: ignore[arg-type]
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_errors_are_anthropic_shaped(server: ServerProcess, served: str) -> None:
    url = f"{server.base_url}/v1/messages"
    ok = {"model": served, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    denied = httpx.post(url, json=ok, timeout=30)
    assert denied.status_code == 401
    assert denied.json() == {"type": "error", "error": {"type": "authentication_error",
                                                        "message": "Incorrect API key provided."}}  # fmt: skip
    assert httpx.post(url, json=ok, headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code == 200
    cases = [
        ({"max_tokens": None}, "max_tokens"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages.0.content.0.type",
        ),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking.type"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        ({"speed": "fast"}, "speed"),
        ({"container": "c1"}, "container"),
        ({"stop_sequences": ["x"] * 17}, "stop_sequences"),
        ({"frobnicate": True}, "frobnicate"),
    ]
    for extra, param in cases:
        body = {**ok, **extra}
        if extra.get("max_tokens", 0) is None:
            del body["max_tokens"]
        r = httpx.post(url, json=body, headers={"x-api-key": KEY}, timeout=30)
        assert r.status_code == 400, (extra, r.text)
        error = r.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
        assert param in error["error"]["message"], (param, error)
    server.log.flush()
    with open(server.log.name, encoding="utf-8") as log:  # each refusal is one line of the server's log
        refusals = [line for line in log if "/v1/messages -> 400" in line]
    for _, param in cases:
        assert any(param in line for line in refusals), (param, refusals)
    # effort, as Anthropic refuses it for a model without the parameter (Claude Code resends without it on these words)
    r = httpx.post(
        url, json={**ok, "output_config": {"effort": "high"}}, headers={"x-api-key": KEY}, timeout=30
    )
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "This model does not support the effort parameter."}}  # fmt: skip
    with pytest.raises(anthropic.NotFoundError):
        anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0).messages.create(
            model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )


def test_structured_output_config(client: anthropic.Anthropic, served: str) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}  # fmt: skip
    m = client.messages.create(
        model=served, max_tokens=60, messages=[{"role": "user", "content": "Name a city as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )  # fmt: skip
    assert isinstance(json.loads(m.content[0].text)["city"], str)  # type: ignore[union-attr]


def test_claude_code_hints_are_accepted(server: ServerProcess, served: str) -> None:
    """A system turn inside messages (a system message there) and thinking.display (nothing to display: this model
    does not think), as Claude Code sends them."""
    body = {"model": served, "max_tokens": 4, "thinking": {"type": "adaptive", "display": "updates"},
            "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                         {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Again"}]}  # fmt: skip
    r = httpx.post(f"{server.base_url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 200, r.text
    count = httpx.post(f"{server.base_url}/v1/messages/count_tokens", json={k: v for k, v in body.items() if k != "max_tokens"},
                       headers={"x-api-key": KEY}, timeout=60)  # fmt: skip
    without = {**body, "messages": [m for m in body["messages"] if m["role"] != "system"]}
    fewer = httpx.post(f"{server.base_url}/v1/messages/count_tokens", json={k: v for k, v in without.items() if k != "max_tokens"},
                       headers={"x-api-key": KEY}, timeout=60)  # fmt: skip
    assert count.json()["input_tokens"] > fewer.json()["input_tokens"]  # the system turn is in the prompt
