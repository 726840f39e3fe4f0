"""OpenAI's Responses API against a real server, through the openai SDK and the openai-agents SDK in its default
(Responses) mode: the embedded model in the default run, Qwen2.5-Coder-1.5B (slow).

The SDKs are the reference for the wire format: ``client.responses.create`` / ``.stream`` / ``.parse`` parse
every object and event into their typed models; the raw event stream is also read by hand to pin the order
OpenAI documents. What the 135M model writes is its business; the protocol is checked.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from serverproc import ServerProcess, model_server

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
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
        request.param, "--max-model-len", "2048", "--num-kv-blocks", "512", "--responses-store-max-count", "4"
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def served(server: ServerProcess) -> str:
    return str(server.model_name)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_create_text_and_usage(client: openai.OpenAI, served: str) -> None:
    r = client.responses.create(
        model=served, input="Say hello.", instructions="Be brief.", max_output_tokens=24, temperature=0
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete")
    if r.status == "incomplete":
        assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
        assert r.usage is not None and r.usage.output_tokens == 24
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output_text and r.output_text == r.output[0].content[0].text
    assert r.usage is not None and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Be brief." and r.max_output_tokens == 24
    # greedy is the chat route's greedy: the same prompt through /v1/chat/completions gives the same text
    chat = client.chat.completions.create(
        model=served, max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}],
    )  # fmt: skip
    assert chat.choices[0].message.content == r.output_text


def test_previous_response_id_continues_and_counts_cached_tokens(client: openai.OpenAI, served: str) -> None:
    first = client.responses.create(
        model=served, input="My name is Ada. Say hi.", max_output_tokens=12, temperature=0
    )
    second = client.responses.create(
        model=served,
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=12,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    # the continuation's prompt holds the first turn and its answer: longer, and served from the prefix cache
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16
    # the same conversation sent whole as input items gives the same answer
    items = [
        {"role": "user", "content": "My name is Ada. Say hi."},
        {"role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": [{"type": "input_text", "text": "What is my name?"}]},
    ]
    whole = client.responses.create(model=served, input=items, max_output_tokens=12, temperature=0)
    assert whole.output_text == second.output_text
    # the first turn's output items re-sent as the SDK dumps them (id, status, phase, annotations, logprobs)
    dumped = [item.model_dump() for item in first.output]
    assert all("phase" in item for item in dumped)
    replayed = [items[0], *dumped, items[2]]
    again = client.responses.create(model=served, input=replayed, max_output_tokens=12, temperature=0)
    assert again.output_text == second.output_text
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_input_items_list_the_chain_through_the_sdk(
    client: openai.OpenAI, served: str, server: ServerProcess
) -> None:
    first = client.responses.create(model=served, input="My name is Ada.", max_output_tokens=6, temperature=0)
    second = client.responses.create(
        model=served,
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=6,
        temperature=0,
    )
    asc = client.responses.input_items.list(second.id, order="asc")
    kinds = [(item.type, getattr(item, "role", None)) for item in asc.data]
    assert kinds == [("message", "user"), ("message", "assistant"), ("message", "user")]
    assert asc.data[0].content[0].text == "My name is Ada."
    assert asc.data[1].id == first.output[0].id  # the earlier answer keeps its own id
    assert asc.data[2].content[0].text == "What is my name?"
    desc = client.responses.input_items.list(second.id)  # OpenAI's default order: newest first
    assert [i.id for i in desc.data] == [i.id for i in reversed(asc.data)]
    page = client.responses.input_items.list(second.id, order="asc", limit=1, after=asc.data[0].id)
    assert [i.id for i in page.data] == [asc.data[1].id] and page.has_more
    bad = httpx.get(f"{server.base_url}/v1/responses/{second.id}/input_items", params={"limit": "0"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")


def test_retrieve_delete_and_not_found(client: openai.OpenAI, served: str, server: ServerProcess) -> None:
    r = client.responses.create(model=served, input="Hi", max_output_tokens=4)
    assert client.responses.retrieve(r.id).id == r.id
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    missing = httpx.post(
        f"{server.base_url}/v1/responses",
        json={"input": "x", "previous_response_id": "resp_nope"},
        timeout=30,
    )
    assert missing.status_code == 404
    assert missing.json()["error"]["param"] == "previous_response_id"
    assert missing.json()["error"]["code"] == "previous_response_not_found"
    unstored = client.responses.create(model=served, input="Hi", max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_store_caps_evict_and_are_counted(client: openai.OpenAI, served: str, server: ServerProcess) -> None:
    before = server.metric("tokenmill:responses_evicted_total")
    ids = [client.responses.create(model=served, input=f"Hi {i}", max_output_tokens=2).id for i in range(6)]
    assert server.metric("tokenmill:responses_stored") == 4  # --responses-store-max-count 4
    assert server.metric("tokenmill:responses_evicted_total") >= before + 2
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])  # the oldest went first
    assert client.responses.retrieve(ids[-1]).id == ids[-1]


def _raw_events(server: ServerProcess, body: dict[str, object]) -> list[dict[str, object]]:
    events = []
    with httpx.stream(
        "POST", f"{server.base_url}/v1/responses", json={**body, "stream": True}, timeout=120
    ) as r:
        assert r.status_code == 200
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == kind
                events.append(data)
    return events


def test_stream_event_sequence(client: openai.OpenAI, served: str, server: ServerProcess) -> None:
    events = _raw_events(server, {"model": served, "input": "Count to three.", "max_output_tokens": 16})
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    ]  # fmt: skip
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete" if events[-1]["response"]["status"] == "incomplete" else "response.completed",  # type: ignore[index]
    ]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(str(e["delta"]) for e in events if e["type"] == "response.output_text.delta")
    assert events[-4]["text"] == text == events[-1]["response"]["output"][0]["content"][0]["text"]  # type: ignore[index]
    # the SDK's stream helper assembles the same response; a schema that must end soon makes it complete
    # whatever the model's greedy path
    three = {
        "type": "object",
        "properties": {"n": {"enum": [1, 2, 3]}},
        "required": ["n"],
        "additionalProperties": False,
    }
    with client.responses.stream(
        model=served, input="Count to three.", max_output_tokens=200, temperature=0,
        text={"format": {"type": "json_schema", "name": "count", "schema": three, "strict": True}},
    ) as s:  # fmt: skip
        sdk_kinds = [event.type for event in s]
        final = s.get_final_response()
    assert sdk_kinds[-1] == "response.completed" and final.status == "completed"
    assert final.output_text and final.usage is not None and final.usage.output_tokens > 0


def test_forced_function_call_and_its_output(
    client: openai.OpenAI, served: str, server: ServerProcess
) -> None:
    r = client.responses.create(
        model=served, input="What is the weather in Rome?", tools=[WEATHER], tool_choice="required",
        max_output_tokens=80,
    )  # fmt: skip
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    # the SDK's way of answering a call: its output item back with the history
    follow = client.responses.create(
        model=served, max_output_tokens=16, tools=[WEATHER],
        input=[
            {"role": "user", "content": "What is the weather in Rome?"},
            *[item.model_dump(exclude_none=True) for item in r.output],
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 24 C"},
        ],
    )  # fmt: skip
    assert follow.status in ("completed", "incomplete") and follow.output
    # streamed: the call is an output item with its argument events
    events = _raw_events(
        server, {"model": served, "input": "Weather in Paris?", "tools": [WEATHER],
                 "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 80},
    )  # fmt: skip
    kinds = [e["type"] for e in events]
    i = kinds.index("response.function_call_arguments.done")
    assert kinds[i - 2 : i + 2] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
    ]  # fmt: skip
    assert json.loads(str(events[i]["arguments"]))["city"]
    assert events[-1]["response"]["output"][-1]["type"] == "function_call"  # type: ignore[index]


class City(BaseModel):
    name: str = Field(max_length=30)
    population: int = Field(ge=0, le=100_000_000)  # bounded: an unbounded integer lets a small model run on


def test_parse_with_a_pydantic_model(client: openai.OpenAI, served: str) -> None:
    r = client.responses.parse(model=served, input="Describe Paris.", text_format=City, max_output_tokens=80)
    assert isinstance(r.output_parsed, City)
    assert r.text.format.type == "json_schema"  # type: ignore[union-attr]


def test_logprobs_through_include(client: openai.OpenAI, served: str) -> None:
    r = client.responses.create(
        model=served, input="Hi", max_output_tokens=5, temperature=0, top_logprobs=2,
        include=["message.output_text.logprobs"],
    )  # fmt: skip
    entries = r.output[0].content[0].logprobs  # type: ignore[union-attr]
    assert entries is not None and len(entries) == r.usage.output_tokens  # type: ignore[union-attr]
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy takes the most likely


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tools[0].type"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"temperature": -1.0}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)  # fmt: skip
def test_refused_fields_are_400s_naming_them(
    server: ServerProcess, extra: dict[str, object], param: str
) -> None:
    body = {"input": "Hi", "max_output_tokens": 4, **extra}
    r = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_openai_agents_default_responses_mode(server: ServerProcess, served: str) -> None:
    """The openai-agents SDK's default model class is the Responses one: a forced function tool through
    Runner.run and Runner.run_streamed."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    model = OpenAIResponsesModel(
        model=served, openai_client=openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    )
    agent = Agent(
        name="weather", instructions="Answer with the tool.", model=model, tools=[get_weather],
        model_settings=ModelSettings(tool_choice="required", max_tokens=80, temperature=0),
        tool_use_behavior="stop_on_first_tool",
    )  # fmt: skip
    result = asyncio.run(Runner.run(agent, "What is the weather in Rome?", max_turns=3))
    assert calls and result.final_output == "sunny"

    async def stream() -> tuple[list[str], object]:
        streamed = Runner.run_streamed(agent, "And in Paris?", max_turns=3)
        return [event.type async for event in streamed.stream_events()], streamed.final_output

    kinds, final = asyncio.run(stream())
    assert "raw_response_event" in kinds and final == "sunny" and len(calls) == 2

    # a second turn after the tool ran: the SDK sends the call and its output back as input items
    chat_agent = Agent(name="chat", instructions="Be brief.", model=model,
                       model_settings=ModelSettings(max_tokens=40, temperature=0))  # fmt: skip
    history = result.to_input_list()
    assert {"function_call", "function_call_output"} <= {item.get("type") for item in history}  # type: ignore[union-attr]
    reply = asyncio.run(
        Runner.run(chat_agent, [*history, {"role": "user", "content": "Thanks!"}], max_turns=2)
    )
    assert isinstance(reply.final_output, str)


def test_codex_cli_request_shape_is_accepted(server: ServerProcess, served: str) -> None:
    """The fields Codex CLI 0.169 sends with every turn (read off its request): developer messages, function
    tools with ``strict: false``, a reasoning summary and encrypted reasoning asked of a model that does not
    reason (nothing to give), its own client_metadata, a prompt_cache_key, store false, streamed."""
    body = {
        "model": served, "stream": True, "store": False, "tool_choice": "auto", "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "01a2362d", "client_metadata": {"turn_id": "t1", "session_id": "s1"},
        "instructions": "You are a coding agent.", "max_output_tokens": 16,
        "input": [
            {"type": "message", "id": "msg_1", "role": "developer",
             "content": [{"type": "input_text", "text": "Sandbox: read-only."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Write hello.py"}]},
        ],
        "tools": [{"type": "function", "name": "exec_command", "description": "Runs a command.", "strict": False,
                   "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}],
    }  # fmt: skip
    events = _raw_events(server, body)
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert not any(item["type"] == "reasoning" for item in events[-1]["response"]["output"])  # type: ignore[index]


def test_a_namespace_call_comes_back_with_its_namespace(server: ServerProcess, served: str) -> None:
    """Codex CLI's shape: a namespace of functions and web_search. The forced call names the function and its
    namespace apart; web_search, which the model can do without, is dropped and the header says so."""
    tool = {"type": "function", "name": "read_file", "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}  # fmt: skip
    body = {"model": served, "input": "Read the file notes.txt.", "max_output_tokens": 100, "temperature": 0,
            "tool_choice": "required",
            "tools": [{"type": "namespace", "name": "mcp__fs", "description": "Files.", "tools": [tool]},
                      {"type": "web_search"}]}  # fmt: skip
    r = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-tokenmill-dropped-tools"] == "web_search"
    (call,) = [item for item in r.json()["output"] if item["type"] == "function_call"]
    assert call["name"] == "read_file" and call["namespace"] == "mcp__fs"
    # the call replayed as the client keeps it, with its output: the conversation continues
    follow = {**body, "tool_choice": "auto", "input": [
        {"role": "user", "content": "Read the file notes.txt."}, call,
        {"type": "function_call_output", "call_id": call["call_id"], "output": "buy milk"}]}  # fmt: skip
    assert httpx.post(f"{server.base_url}/v1/responses", json=follow, timeout=120).status_code == 200
