"""The server through the official ``openai`` client: completions and chat, streamed and not, n > 1, stop
strings, seeds, logprobs, usage; raw SSE framing with httpx; greedy output equals the offline engine's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from serverproc import ServerProcess

from tokenmill.sampling_params import SamplingParams

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def launched() -> Iterator[ServerProcess]:
    proc = ServerProcess("--max-num-seqs", "16").launch()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def reference(launched: ServerProcess) -> Any:
    """The offline engine over the same model on the server's default arithmetic (the ``LLM.generate`` path),
    loaded while the server boots."""
    from tokenmill.engine import Engine

    return Engine(model=None, device="cpu", num_kv_blocks=256, max_model_len=512)


@pytest.fixture(scope="module")
def server(launched: ServerProcess, reference: Any) -> ServerProcess:
    return launched.wait_healthy()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_served_model(server: ServerProcess, model: str) -> None:
    body = httpx.get(f"{server.base_url}/v1/models").json()
    assert body["object"] == "list"
    assert body["data"][0]["id"] == model == "SmolLM2-135M-Instruct"
    assert body["data"][0]["max_model_len"] == 512
    card = body["data"][0]
    assert card["quantization"] in ("gguf", "gguf-q8")  # the arithmetic that runs, and why
    assert (
        card["arithmetic"].startswith(f"arithmetic {card['quantization']} (")
        and "measured on" in card["arithmetic"]
    )


def test_greedy_completion_equals_offline_generate(client: openai.OpenAI, model: str, reference: Any) -> None:
    expected = reference.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert got.choices[0].text == expected.text
    assert got.usage.completion_tokens == len(expected.token_ids)
    streamed = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text


def test_greedy_chat_equals_offline_generate(client: openai.OpenAI, model: str, reference: Any) -> None:
    prompt_ids = reference.tokenizer.encode_chat(CHAT)
    expected = reference.generate([prompt_ids], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    got = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0)
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == expected.text
    assert got.usage.prompt_tokens == len(prompt_ids)
    # max_completion_tokens is the same limit under its new name
    again = client.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=8, temperature=0)
    assert again.choices[0].message.content == expected.text


def test_chat_stream_shape_and_usage(client: openai.OpenAI, model: str) -> None:
    for include_usage in (False, True):
        kwargs: dict[str, Any] = {"stream_options": {"include_usage": True}} if include_usage else {}
        chunks = list(
            client.chat.completions.create(
                model=model, messages=CHAT, max_tokens=6, temperature=0, stream=True, **kwargs
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        content = [c for c in chunks if c.choices]
        assert all(c.choices[0].finish_reason is None for c in content[:-1])
        assert content[-1].choices[0].finish_reason in ("length", "stop")
        with_usage = [c for c in chunks if c.usage is not None]
        if include_usage:
            assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and chunks[-1].choices == []
            assert with_usage[0].usage.completion_tokens <= 6
        else:
            assert with_usage == []


def test_completion_usage_only_when_asked(client: openai.OpenAI, model: str) -> None:
    plain = list(
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, stream=True)
    )
    assert all(c.usage is None for c in plain)
    asked = list(
        client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )  # fmt: skip
    )
    usage = [c.usage for c in asked if c.usage is not None]
    assert len(usage) == 1 and asked[-1].choices == []
    assert (usage[0].prompt_tokens, usage[0].completion_tokens, usage[0].total_tokens) == (5, 4, 9)


def test_n_choices_and_seeds(client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = {
        "model": model, "prompt": PROMPT, "max_tokens": 5, "temperature": 1.0, "seed": 1234,
        "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    a = client.completions.create(n=3, **kwargs)
    b = client.completions.create(n=3, **kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert a.usage.prompt_tokens == 5  # the prompt is counted once
    assert a.usage.completion_tokens == 15  # ignore_eos: every choice runs to max_tokens
    # choice i is seeded with seed + i
    single = client.completions.create(n=1, **{**kwargs, "seed": 1234 + 2})
    assert single.choices[0].text == a.choices[2].text
    streamed = list(client.completions.create(n=3, stream=True, **kwargs))
    texts = ["", "", ""]
    finished = set()
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert texts == [c.text for c in a.choices] and finished == {0, 1, 2}
    chat = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=5, n=2, seed=5, temperature=1.0
    )
    assert [c.index for c in chat.choices] == [0, 1]


def test_stop_string(client: openai.OpenAI, model: str) -> None:
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    cut = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop, "zzzz"]
    )
    choice = cut.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == full[: full.index(stop)]
    streamed = list(
        client.completions.create(
            model=model, prompt=PROMPT, max_tokens=8, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_prompt_shapes(client: openai.OpenAI, model: str, server: ServerProcess) -> None:
    ids = httpx.post(f"{server.base_url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = client.completions.create(model=model, prompt=[PROMPT, "Hello"], max_tokens=3, temperature=0, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text  # greedy: both choices of prompt 0 agree
    lists = client.completions.create(model=model, prompt=[ids, ids[:2]], max_tokens=3, temperature=0)
    assert len(lists.choices) == 2
    assert lists.usage.prompt_tokens == len(ids) + 2
    detok = httpx.post(f"{server.base_url}/detokenize", json={"tokens": ids}).json()
    assert detok == {"prompt": PROMPT}


def test_completion_logprobs_and_echo(client: openai.OpenAI, model: str) -> None:
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == got.usage.completion_tokens
    assert "".join(lp.tokens) == got.choices[0].text
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 0 < len(top) <= 3 and logprob <= 0
        assert logprob == pytest.approx(max(top.values()), abs=1e-4)  # greedy: the sampled token is the best
    echo = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1, echo=True
    )
    lp = echo.choices[0].logprobs
    assert echo.choices[0].text.startswith(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None for x in lp.token_logprobs[1:])
    assert len(lp.tokens) == 5 + 2 and lp.text_offset[0] == 0


def test_chat_logprobs(client: openai.OpenAI, model: str) -> None:
    got = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob, abs=1e-4)
    streamed = list(
        client.chat.completions.create(
            model=model,
            messages=CHAT,
            max_tokens=3,
            temperature=0,
            logprobs=True,
            top_logprobs=1,
            stream=True,
        )
    )
    entries = [
        e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in entries] == [e.token for e in content]


def test_vllm_extras_honoured_and_unknown_fields_refused(client: openai.OpenAI, model: str) -> None:
    got = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0.8,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"13": -100},
        user="someone",
        extra_body={
            "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 6, "ignore_eos": True,
            "stop_token_ids": [2], "skip_special_tokens": True,
        },
    )  # fmt: skip
    assert got.usage.completion_tokens == 6
    # a field tokenmill does not implement is refused by name, never silently ignored
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body={"no_such_field": 1})
    assert info.value.body["param"] == "no_such_field"


def test_raw_sse_framing(server: ServerProcess, model: str) -> None:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")
    assert events[-1] == ""
    events = events[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    payloads = [e[len("data: ") :] for e in events]
    assert payloads.count("[DONE]") == 1 and payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 5
    assert sum(1 for c in chunks if c.get("usage")) == 1


def test_metrics_say_which_kernels_run(server: ServerProcess) -> None:
    """The server exports the kernel variant it loaded: the one this machine's CPU flags and environment pick."""
    import os

    from tokenmill.model.cpu import variants as kv

    expected = kv.choose_variant(kv.read_cpu_info()[1], os.environ.get(kv.ENV_CAP))
    if os.environ.get("TOKENMILL_NO_CPP") == "1":
        expected = "none"
    (key,) = [k for k in server.metrics() if k.startswith("tokenmill:build_info")]
    assert f'kernel_variant="{expected}"' in key


def test_unset_sampling_fields_take_the_model_defaults(client: openai.OpenAI, model: str) -> None:
    """The embedded GGUF has no generation_config.json: a request that sets no sampling field samples with
    tokenmill's documented defaults (generation_defaults.FALLBACK), exactly as one that spells them out; one
    that sets OpenAI's temperature 1.0 and no filters gets what it asked for."""
    from tokenmill.generation_defaults import FALLBACK

    base: dict[str, Any] = {"model": model, "messages": CHAT, "max_tokens": 24, "seed": 77}
    unset = client.chat.completions.create(**base)
    spelled = client.chat.completions.create(
        **base,
        temperature=FALLBACK["temperature"],
        top_p=FALLBACK["top_p"],
        extra_body={k: FALLBACK[k] for k in ("top_k", "min_p", "repetition_penalty")},
    )
    assert unset.choices[0].message.content == spelled.choices[0].message.content
    plain = client.chat.completions.create(
        **base, temperature=1.0, top_p=1.0, extra_body={"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    )
    assert plain.choices[0].message.content != unset.choices[0].message.content  # seeded: deterministic


def test_metrics_carry_the_step_roofline_by_default(
    client: openai.OpenAI, model: str, server: ServerProcess
) -> None:
    """The server starts with the machine's limits (measured once, cached): every step is observed against them."""
    client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    text = httpx.get(f"{server.base_url}/metrics").text
    counts = {
        line.split("kind=")[1].split('"')[1]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tokenmill:step_roofline_fraction_count")
    }
    assert counts.get("decode", 0) >= 3 and counts.get("prefill", 0) + counts.get("mixed", 0) >= 1
