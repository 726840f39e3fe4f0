"""A reasoning model's thinking split from its answer on the chat route (``--reasoning-parser``), read by the
openai SDK as vLLM's ``reasoning`` (and ``reasoning_content``) fields; and ``chat_template_kwargs``.

The embedded model does not think: its answer never closes the thought that the ``deepseek_r1`` parser (``<think>``
opened in the prompt, as DeepSeek-R1's distills do) reads into it, so all of it is reasoning. What is checked is
the routes' wiring: chat's reasoning fields whole and streamed, ``include_reasoning``, a constraint that leaves
the thought alone; a ``reasoning`` item and a ``thinking`` block before an empty answer on the Responses and
Messages routes, read by the openai and anthropic SDKs' stream accumulators and taken back in the next turn's
input. The split itself is tested on recorded outputs (``tests/unit/test_reasoning.py``), and a constraint after
``</think>`` on llguidance's matcher (``tests/unit/test_after_think.py``).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

from tokenmill.reasoning import split
from tokenmill.server.app import build_app
from tokenmill.server.async_engine import AsyncEngine
from tokenmill.server.protocol import ChatCompletionRequest, ParamError
from tokenmill.server.routes_chat import encode_messages

MESSAGES = [{"role": "user", "content": "Think, then answer: what is a cat?"}]


@pytest.fixture(scope="module")
def app(make_engine: Any) -> Iterator[Any]:
    async_engine = AsyncEngine(make_engine(max_model_len=1024), max_queue=16)
    async_engine.start()
    yield build_app(async_engine, "m", reasoning_parser="deepseek_r1")
    async_engine.stop()


@pytest.fixture(scope="module")
def client(app: Any) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120)
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def claude(app: Any) -> anthropic.AsyncAnthropic:
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://test", timeout=120)
    return anthropic.AsyncAnthropic(base_url="http://test", api_key="x", http_client=http, max_retries=0)


def _chat(client: openai.AsyncOpenAI, **body: Any) -> Any:
    return asyncio.run(
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=24, temperature=0, **body)
    )


def test_whole_answer(client: openai.AsyncOpenAI) -> None:
    """The 135M never closes the thought the deepseek_r1 rule opens: all it writes is reasoning."""
    message = _chat(client).choices[0].message
    reasoning = message.model_extra["reasoning"]
    assert message.model_extra["reasoning_content"] == reasoning
    assert reasoning and " " in reasoning and message.content == ""
    assert split("deepseek_r1", reasoning).reasoning == reasoning


def test_streamed_answer_adds_up_to_the_whole(client: openai.AsyncOpenAI) -> None:
    whole = _chat(client).choices[0].message

    async def stream() -> tuple[str, str]:
        reasoning, content = "", ""
        chunks = await client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=24, temperature=0, stream=True
        )
        async for chunk in chunks:
            delta = chunk.choices[0].delta
            extra = delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            reasoning += extra.get("reasoning") or ""
            content += delta.content or ""
            assert not (extra.get("reasoning") and delta.content)  # a piece is one or the other
        return reasoning, content

    assert asyncio.run(stream()) == (whole.model_extra["reasoning"], whole.content)


def test_include_reasoning_false_drops_it(client: openai.AsyncOpenAI) -> None:
    message = _chat(client, extra_body={"include_reasoning": False}).choices[0].message
    assert "reasoning" not in (message.model_extra or {}) and message.content == ""


def test_a_constraint_starts_after_the_thought(client: openai.AsyncOpenAI) -> None:
    """With a reasoning parser a JSON schema constrains the answer, not the thought: the thought the model
    writes under it is exactly what it writes with no constraint (greedy), not JSON from the first token."""
    free = _chat(client).choices[0].message.model_extra["reasoning"]
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    constrained = _chat(client, response_format=fmt).choices[0].message
    assert constrained.model_extra["reasoning"] == free and not free.lstrip().startswith("{")


def _thinking_state(make_engine: Any) -> Any:
    """A state whose tokenizer has a Qwen3-like template switch (``enable_thinking``)."""
    tokenizer = copy.copy(make_engine(max_model_len=256).tokenizer)
    tokenizer.__dict__.pop("_compiled_template", None)
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    )
    engine = SimpleNamespace(tokenizer=tokenizer, max_model_len=256)
    return SimpleNamespace(
        async_engine=engine, tool_call_parser="hermes", default_chat_template_kwargs={"enable_thinking": True}
    )


def test_chat_template_kwargs_reach_the_template(make_engine: Any) -> None:
    state = _thinking_state(make_engine)
    decode = state.async_engine.tokenizer.decode

    def prompt(**fields: Any) -> str:
        req = ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **fields})
        return str(decode(encode_messages(state, req), skip_special_tokens=False))

    assert not prompt().endswith("</think>\n\n")  # the server's default: thinking on
    assert prompt(chat_template_kwargs={"enable_thinking": False}).endswith(
        "</think>\n\n"
    )  # the request's wins
    with pytest.raises(ParamError, match="chat_template_kwargs: 'messages'"):
        prompt(chat_template_kwargs={"messages": []})


PROMPT = "Name three fruits."


def test_responses_reasoning_item(client: openai.AsyncOpenAI) -> None:
    async def run() -> tuple[Any, Any, list[str], Any]:
        whole = await client.responses.create(model="m", input=PROMPT, max_output_tokens=12, temperature=0)
        async with client.responses.stream(model="m", input=PROMPT, max_output_tokens=12, temperature=0) as s:
            events = [event async for event in s]  # the SDK's accumulator indexes items by output_index
        kinds = [event.type for event in events]
        final = events[-1].response  # "response.incomplete": cut by max_output_tokens
        assert {e.output_index for e in events if "reasoning_text" in e.type} == {0}
        assert {e.output_index for e in events if "output_text" in e.type} == {1}
        history = [item.model_dump(exclude_none=True) for item in whole.output]
        again = await client.responses.create(
            model="m", input=[{"role": "user", "content": PROMPT}, *history, {"role": "user", "content": "More?"}],
            max_output_tokens=4,
        )  # fmt: skip
        return whole, final, kinds, again

    whole, final, kinds, again = asyncio.run(run())
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    thought = whole.output[0].content[0].text
    assert thought and whole.output[1].content[0].text == ""  # never closed: all of it is the thought
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == thought and final.output[0].id.startswith("rs_")
    assert "response.reasoning_text.delta" in kinds and kinds.index(
        "response.reasoning_text.done"
    ) < kinds.index("response.output_item.done")
    assert again.status in ("completed", "incomplete")  # the reasoning item sent back is accepted


def test_messages_thinking_block(claude: anthropic.AsyncAnthropic) -> None:
    messages = [{"role": "user", "content": PROMPT}]

    async def run() -> tuple[Any, Any, Any]:
        whole = await claude.messages.create(
            model="m", max_tokens=12, messages=messages, extra_body={"temperature": 0}
        )  # type: ignore[arg-type]
        async with claude.messages.stream(
            model="m", max_tokens=12, messages=messages, extra_body={"temperature": 0}
        ) as s:  # type: ignore[arg-type]
            final = await s.get_final_message()
        history = [*messages, {"role": "assistant", "content": [b.model_dump() for b in whole.content]},
                   {"role": "user", "content": "More?"}]  # fmt: skip
        again = await claude.messages.create(model="m", max_tokens=4, messages=history)  # type: ignore[arg-type]
        return whole, final, again

    whole, final, again = asyncio.run(run())
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking and whole.content[1].text == ""
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == whole.content[0].thinking
    assert again.stop_reason in ("end_turn", "max_tokens")  # the thinking block sent back is accepted
