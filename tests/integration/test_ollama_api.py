"""Ollama's API against a real server on the embedded model, with Ollama's official Python client as the
reference: chat and generate (whole and streamed as newline-delimited JSON), the final object's counts and
durations, ``format`` (JSON and a schema), tools, options, the model listed, shown and running, its Ollama name,
embeddings from an embedding model, and the refusals (images, an option not honoured) in Ollama's error shape."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import ollama
import pytest
from serverproc import ServerProcess

MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--max-model-len", "1024").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> ollama.Client:
    return ollama.Client(host=server.base_url, timeout=120)


@pytest.fixture(scope="module")
def name(client: ollama.Client) -> str:
    return str(client.list().models[0].model)


def test_chat_whole_and_its_counts(client: ollama.Client, name: str) -> None:
    r = client.chat(model=name, messages=MESSAGES, options={"temperature": 0, "num_predict": 12})
    assert (
        r.done and r.done_reason in ("stop", "length") and r.message.role == "assistant" and r.message.content
    )
    assert r.prompt_eval_count and r.prompt_eval_count > 5 and 0 < (r.eval_count or 0) <= 12
    assert r.total_duration and r.prompt_eval_duration and r.eval_duration is not None
    assert (
        r.total_duration >= r.prompt_eval_duration + r.eval_duration
    )  # nanoseconds, from the engine's clock
    assert r.load_duration == 0


def test_chat_streamed_adds_up_to_the_whole(client: ollama.Client, name: str) -> None:
    options = {"temperature": 0, "num_predict": 16, "seed": 1}
    whole = client.chat(model=name, messages=MESSAGES, options=options)
    parts = list(client.chat(model=name, messages=MESSAGES, options=options, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].eval_count == whole.eval_count
    assert "".join(p.message.content for p in parts) == whole.message.content


def test_generate_with_a_system_prompt_and_stop(client: ollama.Client, name: str) -> None:
    r = client.generate(model=name, prompt="Count: one, two,", system="Continue.",
                        options={"temperature": 0, "num_predict": 30, "stop": ["\n"]})  # fmt: skip
    assert r.done and "\n" not in r.response
    parts = list(client.generate(model=name, prompt="Hi", options={"num_predict": 4}, stream=True))
    assert parts[-1].done and 1 <= (parts[-1].eval_count or 0) <= 4 and "".join(p.response for p in parts)


def test_format_json_and_a_schema(client: ollama.Client, name: str) -> None:
    r = client.chat(model=name, messages=[{"role": "user", "content": "A colour as JSON."}], format="json",
                    options={"temperature": 0, "num_predict": 60})  # fmt: skip
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.message.content), dict)
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    r = client.chat(
        model=name, messages=MESSAGES, format=schema, options={"temperature": 0, "num_predict": 30}
    )
    assert json.loads(r.message.content)["n"] in (1, 2, 3)


def test_tools_offered_and_a_tool_answer_taken_back(server: ServerProcess, name: str) -> None:
    """Tools reach the prompt (the 135M rarely calls one: its prompt grows by the tool's description); an earlier
    call (arguments as an object) and the tool's answer (a ``tool`` message naming it) go back in the history."""
    tool = {"type": "function", "function": {"name": "weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                           "required": ["city"]}}}  # fmt: skip
    client = ollama.Client(host=server.base_url, timeout=120)
    ask = [{"role": "user", "content": "Weather in Rome?"}]
    plain = client.chat(model=name, messages=ask, options={"num_predict": 1})
    offered = client.chat(model=name, messages=ask, tools=[tool], options={"num_predict": 1})
    assert (offered.prompt_eval_count or 0) > (plain.prompt_eval_count or 0) + 20
    history = [
        *ask,
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "weather",
                                                                          "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "content": "Sunny, 25 C", "tool_name": "weather"},
    ]  # fmt: skip
    answered = client.chat(model=name, messages=history, tools=[tool], options={"num_predict": 1})
    assert (answered.prompt_eval_count or 0) > (
        offered.prompt_eval_count or 0
    ) + 10  # the call and its answer
    with pytest.raises(ollama.ResponseError) as info:  # a tool answer with no call before it
        client.chat(model=name, messages=[*ask, {"role": "tool", "content": "x"}], options={"num_predict": 1})
    assert info.value.status_code == 400


def test_listed_shown_running_and_its_ollama_name(
    client: ollama.Client, name: str, server: ServerProcess
) -> None:
    (model,) = client.list().models
    assert model.size and model.size > 50e6 and model.details.format == "gguf"
    assert model.details.family == "llama" and model.details.parameter_size.endswith("M")
    assert model.details.quantization_level == "Q4_1"
    shown = client.show(name)
    assert (
        shown.modelinfo["general.architecture"] == "llama" and shown.modelinfo["llama.context_length"] == 1024
    )
    assert "completion" in shown.capabilities and shown.template
    assert [m.model for m in client.ps().models] == [name]
    # the embedded model under the name Ollama's library gives it
    r = client.chat(model="smollm2:135m", messages=MESSAGES, options={"num_predict": 2})
    assert r.done
    assert httpx.head(server.base_url + "/").status_code == 200
    assert httpx.get(server.base_url + "/api/version").json()["version"]


def test_refusals_in_ollama_shape(client: ollama.Client, name: str, server: ServerProcess) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model=name, messages=[{"role": "user", "content": "x", "images": ["aGk="]}])
    assert info.value.status_code == 400 and "images" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model=name, messages=MESSAGES, options={"mirostat": 2})
    assert info.value.status_code == 400 and "options.mirostat" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="llama3:8b", messages=MESSAGES)
    assert info.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model=name, messages=MESSAGES, think=True)
    assert info.value.status_code == 400 and "thinking" in info.value.error
    r = httpx.post(server.base_url + "/api/chat", json={"model": name, "messages": MESSAGES, "stream": False,
                                                        "options": {"num_ctx": 10**6}})  # fmt: skip
    assert r.status_code == 400 and "num_ctx" in r.json()["error"]


@pytest.mark.slow
def test_embeddings_from_an_embedding_model() -> None:
    from tokenmill.model import registry as models

    if models.pulled_path("all-minilm-l6-v2") is None:
        models.pull("all-minilm-l6-v2")
    proc = ServerProcess("--model", "all-minilm-l6-v2", "--max-model-len", "256").start()
    try:
        client = ollama.Client(host=proc.base_url, timeout=120)
        r = client.embed(model="all-minilm", input=["a cat", "a dog"])
        assert len(r.embeddings) == 2 and len(r.embeddings[0]) == 384 and r.prompt_eval_count >= 4
        old = httpx.post(
            proc.base_url + "/api/embeddings", json={"model": "all-minilm:22m", "prompt": "a cat"}
        )
        assert old.json()["embedding"] == pytest.approx(r.embeddings[0], abs=1e-5)
    finally:
        proc.stop()


def test_pull_reports_progress_as_ollama_does(make_engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``/api/pull`` runs ``tokenmill pull`` (here a stand-in that writes three pieces) and streams Ollama's
    progress objects; an unknown name is a 404; ``stream: false`` gives the last object."""
    from tokenmill.model import registry as models
    from tokenmill.server.app import build_app
    from tokenmill.server.async_engine import AsyncEngine

    pulled: list[str] = []

    def fake_pull(name: str, *, on_bytes: Any = None, **_: Any) -> Any:
        pulled.append(name)
        for n in (100, 200, 300):
            on_bytes(n)

    monkeypatch.setattr(models, "pull", fake_pull)
    async_engine = AsyncEngine(make_engine(max_model_len=256), max_queue=4)
    async_engine.start()
    try:
        app = build_app(async_engine, "m")

        async def run() -> tuple[list[dict[str, Any]], dict[str, Any], int]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as c:
                r = await c.post("/api/pull", json={"model": "qwen2.5-coder:0.5b"})
                lines = [json.loads(line) for line in r.text.splitlines()]
                whole = (await c.post("/api/pull", json={"model": "all-minilm", "stream": False})).json()
                missing = await c.post("/api/pull", json={"model": "llama3:8b"})
                return lines, whole, missing.status_code

        lines, whole, missing = asyncio.run(run())
    finally:
        async_engine.stop()
    assert lines[0] == {"status": "pulling manifest"} and lines[-1] == {"status": "success"}
    assert [line["completed"] for line in lines if "completed" in line] == [100, 300, 600]
    assert pulled == ["qwen2.5-coder-0.5b-instruct", "all-minilm-l6-v2"] and whole == {"status": "success"}
    assert missing == 404


def test_langchain_chat_ollama(server: ServerProcess, name: str) -> None:
    """LangChain's ``ChatOllama`` as its docs show it: invoke, stream, structured output, tools offered."""
    from langchain_ollama import ChatOllama
    from pydantic import BaseModel, Field

    llm = ChatOllama(model=name, base_url=server.base_url, temperature=0, num_predict=24)
    reply = llm.invoke("Name a colour.")
    assert reply.content and reply.usage_metadata and reply.usage_metadata["output_tokens"] <= 24
    pieces = [chunk.content for chunk in llm.stream("Name a colour.")]
    assert len(pieces) > 1 and "".join(pieces) == reply.content

    class Colour(BaseModel):
        name: str = Field(max_length=12)

    parsed = (
        ChatOllama(model=name, base_url=server.base_url, temperature=0, num_predict=40)
        .with_structured_output(Colour, method="json_schema")
        .invoke("Pick a colour.")
    )
    assert isinstance(parsed, Colour) and parsed.name

    def weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    answer = llm.bind_tools([weather]).invoke("What is the weather in Rome?")
    assert answer.content or answer.tool_calls  # a reply either way: the tools reached the server


def test_llama_index_ollama(server: ServerProcess, name: str) -> None:
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.ollama import Ollama

    llm = Ollama(model=name, base_url=server.base_url, temperature=0, request_timeout=120,
                 additional_kwargs={"num_predict": 16})  # fmt: skip
    assert llm.complete("The capital of France is").text
    assert llm.chat([ChatMessage(role="user", content="Name a colour.")]).message.content


# Ollama's documented objects (docs/api.md of its repository): the keys each carries
CHUNK_KEYS = {"model", "created_at", "message", "done"}
FINAL_KEYS = CHUNK_KEYS | {"done_reason", "total_duration", "load_duration", "prompt_eval_count",
                           "prompt_eval_duration", "eval_count", "eval_duration"}  # fmt: skip
MODEL_KEYS = {"name", "model", "modified_at", "size", "digest", "details"}
DETAILS_KEYS = {"parent_model", "format", "family", "families", "parameter_size", "quantization_level"}


def test_the_shapes_field_by_field(server: ServerProcess, name: str) -> None:
    url = server.base_url
    body = {"model": name, "messages": MESSAGES, "options": {"num_predict": 3}}
    lines = [json.loads(line) for line in httpx.post(url + "/api/chat", json=body).text.splitlines()]
    assert all(set(line) == CHUNK_KEYS for line in lines[:-1]) and set(lines[-1]) == FINAL_KEYS
    assert set(lines[0]["message"]) == {"role", "content"} and lines[-1]["message"] == {"role": "assistant",
                                                                                       "content": ""}  # fmt: skip
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z", lines[0]["created_at"])
    whole = httpx.post(url + "/api/generate", json={"model": name, "prompt": "Hi", "stream": False,
                                                    "options": {"num_predict": 3}}).json()  # fmt: skip
    assert set(whole) == FINAL_KEYS - {"message"} | {"response"}
    tags = httpx.get(url + "/api/tags").json()
    assert set(tags) == {"models"} and set(tags["models"][0]) == MODEL_KEYS
    assert set(tags["models"][0]["details"]) == DETAILS_KEYS
    ps = httpx.get(url + "/api/ps").json()["models"][0]
    assert set(ps) == MODEL_KEYS - {"modified_at"} | {"expires_at", "size_vram"}
    shown = httpx.post(url + "/api/show", json={"model": name}).json()
    assert {"modelfile", "parameters", "template", "details", "model_info", "capabilities"} <= set(shown)


@pytest.mark.slow
def test_the_1_5b_through_the_clients() -> None:
    """The 1.5B (a template with tools) by its Ollama name: chat, a stream, a tool call from a forced-looking
    question, LangChain's ChatOllama."""
    from langchain_ollama import ChatOllama

    from tokenmill.model import registry as models

    if models.pulled_path("qwen2.5-coder-1.5b-instruct") is None:
        models.pull("qwen2.5-coder-1.5b-instruct")
    proc = ServerProcess("--model", "qwen2.5-coder:1.5b", "--max-model-len", "2048").start()
    try:
        client = ollama.Client(host=proc.base_url, timeout=600)
        name = "qwen2.5-coder:1.5b"
        r = client.chat(model=name, messages=[{"role": "user", "content": "What is 2 + 3? Answer with a number."}],
                        options={"temperature": 0, "num_predict": 8})  # fmt: skip
        assert "5" in r.message.content and r.done_reason == "stop"
        parts = list(
            client.generate(model=name, prompt="def add(a, b):", options={"num_predict": 12}, stream=True)
        )
        assert parts[-1].done and "".join(p.response for p in parts)
        tool = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
        r = client.chat(model=name, messages=[{"role": "user", "content": "What is the weather in Paris? Use the tool."}],
                        tools=[tool], options={"temperature": 0, "num_predict": 60})  # fmt: skip
        (call,) = r.message.tool_calls or [None]
        assert call is not None and call.function.name == "get_weather", r.message.content
        assert "paris" in str(call.function.arguments.get("city", "")).lower()
        reply = ChatOllama(model=name, base_url=proc.base_url, temperature=0, num_predict=8).invoke("Say OK.")
        assert reply.content
    finally:
        proc.stop()
