"""Every error case through the official ``openai`` client's exception types, on a server with an API key
and a tiny queue: 400 (with param), 401, 404, 413, 429 with Retry-After; never FastAPI's 422."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from serverproc import ServerProcess

KEY = "test-key-123"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--max-num-seqs", "2", "--max-queue", "2", "--max-body-bytes", "65536", "--max-tokens-past-context",
        "refuse", env={"TOKENMILL_API_KEY": KEY},
    ).start()  # fmt: skip
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])


def test_key_required_everywhere_but_health_and_metrics(server: ServerProcess) -> None:
    wrong = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.models.list()
    assert info.value.status_code == 401
    assert _error(info.value)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="m", prompt="hi", max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="m", messages=MSGS, max_tokens=1)
    for path in ("/v1/completions", "/tokenize", "/detokenize", "/v1/chat/completions", "/no/such/route"):
        assert httpx.post(f"{server.base_url}{path}", json={}).status_code == 401, path  # no key at all
    assert (
        httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Basic {KEY}"}).status_code
        == 401
    )
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"logprobs": 99}, "logprobs"),
        ({"extra_body": {"top_k": -5}}, "top_k"),
        ({"extra_body": {"repetition_penalty": "high"}}, "repetition_penalty"),  # a type error: 400, not 422
        ({"max_tokens": "many"}, "max_tokens"),
    ],
)
def test_invalid_completion_parameters(
    client: openai.OpenAI, model: str, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="hi", **{"max_tokens": 2, **kwargs})
    assert info.value.status_code == 400
    assert _error(info.value)["param"] == param


def test_empty_prompt_messages_and_out_of_vocab(client: openai.OpenAI, model: str) -> None:
    for prompt in ("", [], [[]]):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model, prompt=prompt, max_tokens=2)
        assert _error(info.value)["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=[], max_tokens=2)
    assert _error(info.value)["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=[1, 2, 10**6], max_tokens=2)
    err = _error(info.value)
    assert err["param"] == "prompt" and "vocabulary" in err["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=model, prompt="hi", max_tokens=2, extra_body={"stop_token_ids": [10**6]}
        )
    assert _error(info.value)["param"] == "stop_token_ids"


def test_context_length_exceeded(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=[1] * 500, max_tokens=100)
    err = _error(info.value)
    assert err["code"] == "context_length_exceeded"
    assert err["message"] == (
        "This model's maximum context length is 512 tokens. However, you requested 600 tokens "
        "(500 in the messages, 100 in the completion). Please reduce the length of the messages or completion."
    )
    long_chat = [{"role": "user", "content": "word " * 600}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=long_chat, max_completion_tokens=10)
    assert _error(info.value)["code"] == "context_length_exceeded"


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=2)
    err = _error(info.value)
    assert err["param"] == "model" and err["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-17", messages=MSGS, max_tokens=2)


def test_oversized_body_is_413(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=model, prompt="x" * 70_000, max_tokens=2)
    assert info.value.status_code == 413
    assert _error(info.value)["code"] == "request_too_large"


def test_full_queue_is_429_with_retry_after(server: ServerProcess, client: openai.OpenAI, model: str) -> None:
    """2 running + 2 waiting fill the server; the next request gets 429, never a 5xx; then all drain."""
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": model, "prompt": "Count:", "max_tokens": 400, "stream": True, "ignore_eos": True}
    stop = threading.Event()
    statuses: list[int] = []

    def hold() -> None:
        with httpx.stream(
            "POST", f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=120
        ) as r:
            statuses.append(r.status_code)
            for _ in r.iter_lines():
                if stop.is_set():
                    return  # leaving the block drops the connection: the server aborts the request

    def wait_for(name: str, value: float) -> None:
        deadline = time.monotonic() + 60
        while server.metric(name) < value and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.metric(name) == value

    threads = [threading.Thread(target=hold) for _ in range(4)]
    try:
        # Two fill the batch; once they run, two more fill the queue (a request counts as waiting until
        # the engine admits it, so the four are sent in two waves).
        for t in threads[:2]:
            t.start()
        wait_for("vllm:num_requests_running", 2)
        for t in threads[2:]:
            t.start()
        wait_for("tokenmill:num_requests_in_flight", 4)
        assert server.metric("vllm:num_requests_waiting") == 2
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=model, prompt="hi", max_tokens=2)
        assert info.value.status_code == 429
        assert int(info.value.response.headers["retry-after"]) >= 1
        assert _error(info.value)["type"] == "rate_limit_error"
        assert server.metric("tokenmill:queue_rejections_total") >= 1
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert statuses == [200] * 4
    deadline = time.monotonic() + 10
    while server.metric("tokenmill:num_requests_in_flight") > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric("tokenmill:num_requests_in_flight") == 0
    assert server.metric("vllm:kv_cache_usage_perc") == 0
    # and the server answers again
    assert client.completions.create(model=model, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
