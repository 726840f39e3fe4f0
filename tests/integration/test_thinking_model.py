"""A thinking model end to end through the server under vLLM's ``qwen3`` reasoning parser: a tiny Qwen3 built by
transformers whose weights are set so that its greedy answer is known, ``<think>Hmm</think>Yes``, with
``<think>`` and ``</think>`` single tokens and a Qwen3-like template (``enable_thinking``).

How the weights make that answer: every layer's output projections are zero, so the last hidden state is the
current token's embedding; each token of the answer's chain has an embedding of its own direction (plus a shared
one), and the head maps each direction to the chain's next token. The shared direction ranks a few tokens for a
constrained answer (``{"``, ``}``, ``1``, ``"``), so JSON under a schema and a forced tool call end quickly.

Checked with the openai and anthropic SDKs: chat (``message.reasoning`` read from ``model_extra``, and streamed),
Responses (a reasoning item, then the message), Messages (a thinking block, then text), ``enable_thinking: false``
(the template closes the thought; all of the answer is content), a JSON schema and a forced tool call that start
after ``</think>`` (the thought stays the model's own)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
import torch

transformers = pytest.importorskip("transformers")

from tokenmill.engine import Engine  # noqa: E402
from tokenmill.server.app import build_app  # noqa: E402
from tokenmill.server.async_engine import AsyncEngine  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Is water wet?"}]


def build_thinking_model(out: Path, hf_gguf: Any) -> Path:
    from tokenmill.model.embedded import embedded_model_path

    path = embedded_model_path()
    tok = hf_gguf.tokenizer(path)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(out)
    ids = {
        s: tok.convert_tokens_to_ids(s)
        for s in ("Ċ", "ĊĊ", "<think>", "</think>", "H", "mm", "Yes", "<|im_end|>")
    }
    chain = [("Ċ", "<think>"), ("<think>", "H"), ("H", "mm"), ("mm", "</think>"), ("</think>", "Yes"),
             ("Yes", "<|im_end|>"), ("ĊĊ", "Yes")]  # fmt: skip
    prefer = {
        '{"': 6.0,
        "}": 5.0,
        "1": 4.0,
        '"': 3.0,
    }  # the shared direction's ranking, for constrained answers
    config = transformers.Qwen3Config(
        vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=ids["<|im_end|>"], pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()  # every layer adds nothing: the last hidden state is the token's embedding
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed.zero_(), head.zero_()
        embed[:, 0] = 1.0  # the shared direction
        for slot, (current, following) in enumerate(chain, start=1):
            embed[ids[current], slot] = 1.0
            head[ids[following], slot] = 20.0
        for text, weight in prefer.items():
            head[tok.convert_tokens_to_ids(text) if text != '{"' else tok.encode(text)[0], 0] = weight
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory, hf_gguf: Any) -> Iterator[Any]:
    folder = build_thinking_model(tmp_path_factory.mktemp("thinking"), hf_gguf)
    engine = Engine(model=str(folder), device="cpu", num_kv_blocks=64, speculative_config=None)
    async_engine = AsyncEngine(engine, max_queue=8)
    async_engine.start()
    yield build_app(async_engine, "q", reasoning_parser="qwen3")
    async_engine.stop()


@pytest.fixture(scope="module")
def client(app: Any) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120)
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)


def chat(client: openai.AsyncOpenAI, **body: Any) -> Any:
    return asyncio.run(
        client.chat.completions.create(model="q", messages=MESSAGES, max_tokens=40, temperature=0, **body)
    )


def test_chat_splits_the_thought_whole_and_streamed(client: openai.AsyncOpenAI) -> None:
    message = chat(client).choices[0].message
    assert message.model_extra["reasoning"] == "Hmm" == message.model_extra["reasoning_content"]
    assert message.content == "Yes"

    async def stream() -> tuple[str, str]:
        chunks = await client.chat.completions.create(
            model="q", messages=MESSAGES, max_tokens=40, temperature=0, stream=True
        )
        reasoning, content = "", ""
        async for chunk in chunks:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning") or ""
            content += delta.content or ""
        return reasoning, content

    assert asyncio.run(stream()) == ("Hmm", "Yes")


def test_thinking_off_leaves_only_the_answer(client: openai.AsyncOpenAI) -> None:
    message = chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert message.content == "Yes" and not (message.model_extra or {}).get("reasoning")


def test_a_schema_and_a_forced_tool_call_start_after_the_thought(client: openai.AsyncOpenAI) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    message = chat(client, response_format=fmt).choices[0].message
    assert message.model_extra["reasoning"] == "Hmm"
    assert json.loads(message.content) == {"a": 1}
    tool = {"type": "function", "function": {"name": "get", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
    forced = chat(client, tools=[tool], tool_choice={"type": "function", "function": {"name": "get"}})
    call_message = forced.choices[0].message
    assert call_message.model_extra["reasoning"] == "Hmm"
    (call,) = call_message.tool_calls
    assert call.function.name == "get" and set(json.loads(call.function.arguments)) == {"city"}
    assert forced.choices[0].finish_reason == "tool_calls"


def test_responses_and_messages(app: Any, client: openai.AsyncOpenAI) -> None:
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://test", timeout=120)
    claude = anthropic.AsyncAnthropic(base_url="http://test", api_key="x", http_client=http, max_retries=0)

    async def run() -> tuple[Any, Any]:
        response = await client.responses.create(model="q", input="Is water wet?", temperature=0)
        message = await claude.messages.create(
            model="q", max_tokens=40, messages=MESSAGES, extra_body={"temperature": 0}
        )  # type: ignore[arg-type]
        return response, message

    response, message = asyncio.run(run())
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "Hmm" and response.output_text == "Yes"
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", "Hmm"), ("text", "Yes")
    ]  # fmt: skip
    assert message.stop_reason == "end_turn"
