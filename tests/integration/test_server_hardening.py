"""The server as an attacker and as common clients meet it: a bad-input table (every case a 4xx in OpenAI's
shape naming its ``param``, and the server still answering), slow and oversized clients, the routes clients
look for (the SDK's ``models.retrieve``, ``/version``, vLLM's ``/tokenizer_info``), CORS, and an OpenAPI schema
that carries the request bodies."""

from __future__ import annotations

import json
import math
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from serverproc import ServerProcess

ORIGIN = "https://app.example"
M = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--max-queue", "4", "--header-timeout", "1", "--body-timeout", "1", "--max-header-bytes", "16384",
        "--allowed-origins", json.dumps([ORIGIN]), "--max-tokens-past-context", "refuse",  # OpenAI's 400 kept
    ).start()  # fmt: skip
    yield proc
    proc.stop()


def _still_serves(server: ServerProcess) -> None:
    r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text


C, CH = "/v1/completions", "/v1/chat/completions"
DEEP = b"[" * 10_000 + b"]" * 10_000
# (path, body: a dict or raw bytes, status, param)
BAD: list[tuple[str, Any, int, str | None]] = [
    (C, DEEP, 400, None),  # RecursionError before
    (C, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400, None),  # 5,000-digit integer
    (C, b'{"prompt": "x", "temperature": NaN}', 400, None),
    (C, b'{"prompt": "x"', 400, None),
    (C, b"\xff\xfe{}", 400, None),
    (C, b"[1, 2]", 400, None),
    (C, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (C, {"prompt": "x", "n": "2"}, 400, "n"),
    (C, {"prompt": "x", "echo": 1}, 400, "echo"),
    (C, {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
    (C, {"prompt": "x", "tools": []}, 400, "tools"),
    (C, {"prompt": "x", "response_format": {"type": "xml"}}, 400, "response_format.type"),
    (C, {"prompt": "x", "guided_regex": "(unclosed"}, 400, "guided_regex"),
    (C, {"prompt": "x", "guided_json": {"type": "no-such-type"}}, 400, "guided_json"),
    (C, {"prompt": "x", "guided_choice": []}, 400, "guided_choice"),
    (C, {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, 400, "guided_choice"),
    (CH, {"messages": M, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    (CH, {"messages": M, "structured_outputs": {"grammar": "start: !!"}}, 400, "structured_outputs"),
    (C, {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    (C, {}, 400, "prompt"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": [[]]}, 400, "prompt"),
    (C, {"prompt": [10**9]}, 400, "prompt"),
    (C, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "x", "top_k": -5}, 400, "top_k"),
    (C, {"prompt": "x", "min_p": 2}, 400, "min_p"),
    (C, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    (C, {"prompt": "x", "n": 0}, 400, "n"),
    (C, {"prompt": "x", "n": 5}, 400, "n"),  # more choices than --max-queue: could never be queued
    (C, {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    (C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),  # outside the vocabulary
    (C, {"prompt": "x", "logit_bias": {"1": 500}}, 400, "logit_bias"),
    (C, {"prompt": "x", "stop": ["a"] * 17}, 400, "stop"),
    (C, {"prompt": "x", "stop": "s" * 513}, 400, "stop"),
    (C, {"prompt": "x", "stop_token_ids": list(range(257))}, 400, "stop_token_ids"),
    (C, {"prompt": "x", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    (C, {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    (C, {"prompt": "x", "best_of": 3}, 400, "best_of"),
    (C, {"prompt": "x", "max_tokens": 100_000}, 400, "messages"),
    (C, {"prompt": "x", "model": "no-such-model"}, 404, "model"),
    (CH, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    (CH, {"messages": [{"role": "user", "content": None}]}, 400, "messages.0"),
    (CH, {"messages": [{"role": "user"}]}, 400, "messages.0"),
    (CH, {"messages": []}, 400, "messages"),
    (CH, {"messages": "hi"}, 400, "messages"),
    (
        CH,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages",
    ),
    (CH, {"messages": M, "stream": "yes"}, 400, "stream"),
    (CH, {"messages": M, "top_logprobs": 3}, 400, "top_logprobs"),
    (CH, {"messages": M, "tools": [{"type": "function"}]}, 400, "tools.0.function"),
    (CH, {"messages": M, "audio": {"voice": "x"}}, 400, "audio"),
    (CH, {"messages": M, "logprobs": "true"}, 400, "logprobs"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD)
def test_bad_input_is_an_openai_shaped_4xx(
    server: ServerProcess, path: str, body: Any, status: int, param: str | None
) -> None:
    url = f"{server.base_url}{path}"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=60)
    else:
        r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error


def test_server_answers_after_every_bad_input(server: ServerProcess) -> None:
    assert len(BAD) >= 40
    for path, body, _, _ in BAD:
        kwargs: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
        assert httpx.post(f"{server.base_url}{path}", timeout=60, **kwargs).status_code < 500
    _still_serves(server)
    assert "Traceback" not in server.output()


def _held_open(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(4096) != b"" and True
    except TimeoutError:
        return True
    except OSError:
        return False


def test_slow_clients_are_closed_after_the_timeouts(server: ServerProcess) -> None:
    socks = []
    for i in range(60):
        s = socket.create_connection(("127.0.0.1", server.port))
        if i % 2:  # headers never finished
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        else:  # a body declared and never sent
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
        socks.append(s)
    time.sleep(2.5)  # past both 1 s timeouts
    answers = []
    for s in socks:
        s.settimeout(2)
        try:
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            answers.append(data)
        except TimeoutError:
            answers.append(None)  # still open: a failure
        finally:
            s.close()
    assert all(a is not None for a in answers), "some slow connections are still open"
    assert all(b" 408 " in a for a in answers[0::2]), answers[0]  # the body timeout answers 408
    _still_serves(server)


def test_oversized_headers_get_431(server: ServerProcess) -> None:
    r = httpx.get(f"{server.base_url}/v1/models", headers={"X-Big": "a" * 100_000}, timeout=30)
    assert r.status_code == 431
    assert r.json()["error"]["message"]
    _still_serves(server)


def test_sdk_models_retrieve_version_and_tokenizer_info(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    name = client.models.list().data[0].id
    card = client.models.retrieve(name)
    assert card.id == name and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert httpx.get(f"{server.base_url}/version").json()["version"]
    info = httpx.get(f"{server.base_url}/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == 512
    assert "im_start" in info["chat_template"]


def test_cors_preflight_allowed_and_refused_origins(server: ServerProcess) -> None:
    url = f"{server.base_url}/v1/chat/completions"
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    ok = httpx.options(url, headers={"Origin": ORIGIN, **ask})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    refused = httpx.options(url, headers={"Origin": "https://evil.example", **ask})
    assert refused.status_code == 400
    assert "access-control-allow-origin" not in refused.headers
    simple = httpx.get(f"{server.base_url}/v1/models", headers={"Origin": ORIGIN})
    assert simple.headers["access-control-allow-origin"] == ORIGIN


def test_openapi_describes_the_request_bodies(server: ServerProcess) -> None:
    schema = httpx.get(f"{server.base_url}/openapi.json").json()
    schemas = schema["components"]["schemas"]
    for path, model in [
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/tokenize", "TokenizeRequest"),
        ("/detokenize", "DetokenizeRequest"),
    ]:
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert model in schemas
    assert "prompt" in schemas["CompletionRequest"]["properties"]
    assert "ChatMessage" in schemas  # nested models resolve too


def test_sampling_fields_change_the_output_as_specified(server: ServerProcess) -> None:
    url = f"{server.base_url}/v1/completions"
    base = {"prompt": "The capital of France is", "max_tokens": 6, "ignore_eos": True}
    token = httpx.post(f"{server.base_url}/tokenize", json={"prompt": " banana"}).json()["tokens"][-1]
    biased = httpx.post(
        url, json={**base, "temperature": 1.0, "seed": 3, "logit_bias": {str(token): 100}, "logprobs": 0}
    ).json()
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": [token] * 6}).json()["prompt"]
    assert biased["choices"][0]["text"] == text  # +100 on one token: it is every token
    greedy = httpx.post(url, json={**base, "temperature": 0}).json()["choices"][0]["text"]
    for seed in (1, 2):  # top_k=1 leaves one candidate whatever the temperature and the seed
        # (repetition_penalty 1.0: a sampled request otherwise takes the default 1.1, which greedy does not)
        top1 = httpx.post(
            url, json={**base, "temperature": 1.5, "top_k": 1, "seed": seed, "repetition_penalty": 1.0}
        ).json()
        assert top1["choices"][0]["text"] == greedy


def test_echo_with_max_tokens_0_scores_the_prompt(server: ServerProcess) -> None:
    """How lm-eval scores a prompt: echo, max_tokens=0, logprobs; the same entries as with a token sampled."""
    url = f"{server.base_url}/v1/completions"
    prompt = "The capital of France is Paris"
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "temperature": 0}
    scored = httpx.post(url, json={**body, "max_tokens": 0}).json()
    choice = scored["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert scored["usage"]["completion_tokens"] == 0
    num_prompt_tokens = scored["usage"]["prompt_tokens"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == num_prompt_tokens
    assert lp["token_logprobs"][0] is None and all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    with_token = httpx.post(url, json={**body, "max_tokens": 1}).json()["choices"][0]["logprobs"]
    assert with_token["token_logprobs"][:num_prompt_tokens] == pytest.approx(lp["token_logprobs"], abs=1e-4)
    chat = httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": M, "max_tokens": 0})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_tokens"


def _steps(choice: dict[str, Any]) -> list[tuple[str, float, dict[str, float]]]:
    lp = choice["logprobs"]
    return list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True))


def test_min_p_keeps_only_tokens_near_the_best(server: ServerProcess) -> None:
    """At temperature 1 the sampled token's raw probability is at least min_p x the best one's, each step;
    without min_p, the same seeds do pick tokens below that line (so the check can fail)."""
    url = f"{server.base_url}/v1/completions"
    base = {
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "temperature": 1.0,
        "logprobs": 5,
        "ignore_eos": True,
        "repetition_penalty": 1.0,  # the raw logprobs are the check's reference: no default penalty on top
    }
    below_without = 0
    for seed in range(6):
        with_min_p = httpx.post(url, json={**base, "seed": seed, "min_p": 0.3}).json()["choices"][0]
        for _, logprob, top in _steps(with_min_p):
            assert logprob >= math.log(0.3) + max(top.values()) - 1e-4
        unfiltered = {"temperature": 1.5, "min_p": 0.0, "top_k": -1, "top_p": 1.0}  # no default filter either
        free = httpx.post(url, json={**base, "seed": seed, **unfiltered}).json()["choices"][0]
        below_without += sum(lp < math.log(0.3) + max(top.values()) for _, lp, top in _steps(free))
    assert below_without > 0


def _penalised(top: dict[str, float], token: str, counts: dict[str, int], field: str) -> float:
    n = counts.get(token, 0)
    return top[token] - (2.0 * (n > 0) if field == "presence_penalty" else 2.0 * n)


def test_presence_and_frequency_penalties_as_computed_by_hand(server: ServerProcess) -> None:
    """Greedy with a penalty: each token is the argmax of (raw logprob - penalty for the tokens already
    generated), worked out from the raw top-20 logprobs the server returns."""
    url = f"{server.base_url}/v1/completions"
    base = {"prompt": "My favourite colours are", "max_tokens": 16, "temperature": 0, "logprobs": 20,
            "ignore_eos": True}  # fmt: skip
    plain = httpx.post(url, json=base).json()["choices"][0]["text"]
    for field in ("presence_penalty", "frequency_penalty"):
        choice = httpx.post(url, json={**base, field: 2.0}).json()["choices"][0]
        counts: dict[str, int] = {}
        for token, _, top in _steps(choice):
            assert token in top
            best = max(_penalised(top, t, counts, field) for t in top)
            assert _penalised(top, token, counts, field) >= best - 1e-4, (field, token, counts)
            counts[token] = counts.get(token, 0) + 1
        assert choice["text"] != plain  # the penalty changed what greedy says


def test_twenty_dropped_long_prompts_leave_nothing_behind(server: ServerProcess) -> None:
    prompt = " ".join(["word"] * 480)
    for _ in range(20):
        body = {"prompt": prompt, "max_tokens": 16, "stream": True}
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", f"{server.base_url}/v1/completions", json=body),
        ):
            time.sleep(0.05)  # gone before its prefill finished
    deadline = time.monotonic() + 30
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "tokenmill:num_requests_in_flight")
    while time.monotonic() < deadline and any(server.metric(name) for name in names):
        time.sleep(0.2)  # the last aborts are applied at the next step boundary
    assert server.metric("vllm:num_requests_running") == 0
    assert server.metric("vllm:num_requests_waiting") == 0
    assert server.metric("vllm:kv_cache_usage_perc") == 0
    assert server.metric("tokenmill:num_requests_in_flight") == 0
    _still_serves(server)
