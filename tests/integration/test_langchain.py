"""LangChain's ChatOpenAI against the server: with_structured_output (json_schema, function_calling,
json_mode) and bind_tools with a forced tool."""

from __future__ import annotations

from collections.abc import Iterator

import langchain_openai  # a dev dependency: a missing one fails the test run, never skips it
import pytest
from pydantic import BaseModel
from serverproc import ServerProcess


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def llm() -> Iterator[object]:
    proc = ServerProcess("--max-model-len", "1024").start()
    model = langchain_openai.ChatOpenAI(
        base_url=f"{proc.base_url}/v1", api_key="unused", model="SmolLM2-135M-Instruct", temperature=0,
        max_tokens=120, max_retries=0, presence_penalty=1.0,
    )  # fmt: skip
    yield model
    proc.stop()


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(llm: object, method: str) -> None:
    structured = llm.with_structured_output(Person, method=method)  # type: ignore[attr-defined]
    got = structured.invoke("Invent a person with a name and an age.")
    assert isinstance(got, Person)


def test_with_structured_output_json_mode(llm: object) -> None:
    structured = llm.with_structured_output(None, method="json_mode")  # type: ignore[attr-defined]
    got = structured.invoke("Describe a person as a JSON object with keys name and age.")
    assert isinstance(got, dict)


def test_bind_tools_forced(llm: object) -> None:
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    bound = llm.bind_tools([get_weather], tool_choice="get_weather")  # type: ignore[attr-defined]
    msg = bound.invoke("What is the weather in Rome?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
