"""The client libraries agents are built with, against a real server on the embedded model.

Each library is a dev dependency (a missing one fails the run, never skips it) and is used as its own docs
show, pointed at tokenmill's base URL: the openai SDK (a reply's ``model_dump()`` appended to the history,
``parse()`` with pydantic models whose schemas carry ``$defs``, enums, optional and recursive fields),
instructor (JSON_SCHEMA and TOOLS modes), pydantic-ai (``output_type`` and a tool), the openai-agents SDK (a
chat-completions model with a function tool) and llama-index (``OpenAILike`` chat and ``structured_predict``).
The 135M model is no agent: what is checked is the protocol (every request accepted, every structured answer
valid for its schema, every forced call parsed), not the quality of the answers.
"""

from __future__ import annotations

import asyncio
import enum
import json
from collections.abc import Iterator
from typing import Annotated

import httpx
import instructor
import openai
import pytest
from pydantic import BaseModel, Field
from serverproc import ServerProcess, model_server

MODEL = "SmolLM2-135M-Instruct"


class Currency(enum.StrEnum):
    EUR = "EUR"
    USD = "USD"


class Price(BaseModel):
    amount: int = Field(ge=0, le=10_000)
    currency: Currency


class Product(BaseModel):
    """A nested model, an enum and an optional field: pydantic writes $defs and $ref for them."""

    name: str = Field(max_length=40)
    price: Price
    discount: Price | None = None
    tags: list[Annotated[str, Field(max_length=16)]] = Field(default_factory=list, max_length=3)


class Node(BaseModel):
    """A recursive model: its schema refers to itself through $defs."""

    label: str = Field(max_length=12)
    children: list[Node] = Field(default_factory=list, max_length=2)


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(None, id="smollm2-135m"),
        pytest.param("qwen2.5-coder-1.5b-instruct", id="qwen2.5-1.5b", marks=pytest.mark.slow),
    ],
)
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """The server on the embedded model (the default run) and on the 1.5B (slow: pulled once, then cached)."""
    proc = model_server(request.param, "--max-model-len", "2048", "--num-kv-blocks", "512")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def served(server: ServerProcess) -> str:
    return str(server.model_name)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_history_as_the_sdk_hands_it_back(client: openai.OpenAI, served: str) -> None:
    """Appending ``message.model_dump()`` (refusal, annotations, audio, function_call: None; a call's index)
    and sending fields whose values ask for nothing (store false, metadata, service_tier, user)."""
    tools = [openai.pydantic_function_tool(Price, name="quote")]
    messages: list[dict] = [{"role": "user", "content": "Quote a price."}]
    first = client.chat.completions.create(
        model=served, messages=messages, tools=tools, tool_choice="required", max_tokens=60, temperature=0
    )
    reply = first.choices[0].message
    assert reply.tool_calls and reply.tool_calls[0].function.name == "quote"
    messages.append(reply.model_dump())  # refusal=None, annotations=None, audio=None, function_call=None ...
    messages.append({"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "ok"})
    streamed = client.chat.completions.create(
        model=served, messages=messages, max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(streamed)
    assert chunks[-1].usage is not None
    again = client.chat.completions.create(
        model=served, messages=messages, max_tokens=8, store=False, metadata={"run": "test"},
        service_tier="auto", user="u-1",
    )  # fmt: skip
    assert again.choices[0].finish_reason in ("stop", "length")
    history_with_index = [
        *messages[:1],
        {**messages[1], "tool_calls": [{**messages[1]["tool_calls"][0], "index": 0}]},
        messages[2],
    ]
    client.chat.completions.create(model=served, messages=history_with_index, max_tokens=4)


@pytest.mark.parametrize(
    ("field", "value"), [("store", True), ("service_tier", "flex"), ("modalities", ["text", "audio"])]
)
def test_a_field_that_asks_for_what_tokenmill_lacks_is_a_400_naming_it(
    client: openai.OpenAI, served: str, field: str, value: object
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=served,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_body={field: value},
        )
    assert field in str(info.value)


def test_parse_a_model_with_defs_enum_and_optional(client: openai.OpenAI, served: str) -> None:
    schema = Product.model_json_schema()
    assert "$defs" in schema  # the shape that used to break forced calls
    got = client.chat.completions.parse(
        model=served, messages=[{"role": "user", "content": "Describe a product for sale."}],
        response_format=Product, max_tokens=200, temperature=0,
    )  # fmt: skip
    product = got.choices[0].message.parsed
    assert isinstance(product, Product) and isinstance(product.price.currency, Currency)


def test_forced_tool_call_with_defs_and_recursion(client: openai.OpenAI, served: str) -> None:
    tools = [openai.pydantic_function_tool(Product), openai.pydantic_function_tool(Node)]
    for name, model in (("Product", Product), ("Node", Node)):
        got = client.chat.completions.create(
            model=served, messages=[{"role": "user", "content": "Call the function."}], tools=tools,
            tool_choice={"type": "function", "function": {"name": name}}, max_tokens=300, temperature=0,
        )  # fmt: skip
        choice = got.choices[0]
        if choice.finish_reason == "length":  # a recursive schema may nest until the budget ends
            assert name == "Node"
            continue
        (call,) = choice.message.tool_calls
        assert call.function.name == name
        model.model_validate_json(call.function.arguments)


def test_structured_outputs_with_a_recursive_schema(client: openai.OpenAI, served: str) -> None:
    got = client.chat.completions.create(
        model=served, messages=[{"role": "user", "content": "A tree."}], max_tokens=300, temperature=0,
        extra_body={"structured_outputs": {"json": Node.model_json_schema()}},
    )  # fmt: skip
    choice = got.choices[0]
    if choice.finish_reason != "length":
        Node.model_validate_json(choice.message.content)


@pytest.mark.parametrize("mode", [instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS])
def test_instructor(client: openai.OpenAI, served: str, mode: instructor.Mode) -> None:
    patched = instructor.from_openai(client, mode=mode)
    got = patched.chat.completions.create(
        model=served, response_model=Product, max_retries=0, max_tokens=200, temperature=0,
        messages=[{"role": "user", "content": "Describe a product for sale."}],
    )  # fmt: skip
    assert isinstance(got, Product)


def test_pydantic_ai_output_type_and_a_tool(server: ServerProcess, served: str) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    model = OpenAIChatModel(
        served, provider=OpenAIProvider(base_url=f"{server.base_url}/v1", api_key="unused")
    )
    settings = ModelSettings(max_tokens=200, temperature=0)
    agent = Agent(model, output_type=Price, model_settings=settings, retries=0)
    result = agent.run_sync("Give a price in euros.")
    assert isinstance(result.output, Price)

    tooled = Agent(model, model_settings=ModelSettings(max_tokens=60, temperature=0))
    calls: list[str] = []

    @tooled.tool_plain
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    out = tooled.run_sync("What is the weather in Rome? Use the tool.")
    assert isinstance(out.output, str)  # with tool_choice auto the model decides; the run must complete


def test_openai_agents_chat_completions_model_with_a_function_tool(
    server: ServerProcess, served: str
) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    model = OpenAIChatCompletionsModel(
        model=served, openai_client=openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    )
    agent = Agent(
        name="weather", instructions="Answer with the tool.", model=model, tools=[get_weather],
        model_settings=ModelSettings(tool_choice="required", max_tokens=60, temperature=0),
        tool_use_behavior="stop_on_first_tool",  # the tool's answer is the run's: no second forced turn
    )  # fmt: skip
    result = asyncio.run(Runner.run(agent, "What is the weather in Rome?", max_turns=3))
    assert calls, "the forced tool call reached the function"
    assert result.final_output == "sunny"

    async def stream() -> tuple[list[str], object]:
        streamed = Runner.run_streamed(agent, "And in Paris?", max_turns=3)
        return [event.type async for event in streamed.stream_events()], streamed.final_output

    kinds, final = asyncio.run(stream())
    assert "raw_response_event" in kinds and final == "sunny" and len(calls) == 2


def test_llama_index_openai_like(server: ServerProcess, served: str) -> None:
    from llama_index.core.llms import ChatMessage
    from llama_index.core.prompts import PromptTemplate
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(
        model=served, api_base=f"{server.base_url}/v1", api_key="unused", is_chat_model=True,
        is_function_calling_model=True, max_tokens=200, temperature=0, max_retries=0, context_window=2048,
    )  # fmt: skip
    reply = llm.chat([ChatMessage(role="user", content="Say hello.")])
    assert isinstance(reply.message.content, str)
    product = llm.structured_predict(
        Product, PromptTemplate("Describe a product for sale: {item}"), item="a pen"
    )
    assert isinstance(product, Product)


def test_a_grammar_failure_is_never_a_429(server: ServerProcess, served: str) -> None:
    """An invalid constraint is a 400 naming its field; nothing about a constraint is ever a 429."""
    r = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": served, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
              "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
        timeout=30,
    )  # fmt: skip
    assert r.status_code == 400, r.text
    assert json.loads(r.text)["error"]["param"] == "response_format"
