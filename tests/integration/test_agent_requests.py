"""What coding agents' CLIs send, replayed against the server on the embedded model in process.

``agent_requests/<agent>.jsonl`` holds the requests Claude Code, Codex CLI and opencode sent with their default
configuration (only the base URL, a key and the model name set), captured by ``python -m
benchmarks.agent_turns --write-fixtures DIR`` with every text longer than 40 characters replaced by a
placeholder; each line names the client and its version. Each request must be accepted, or refused as the real
API refuses it so that the client's own fallback works (docs/API_FIELDS.md): Claude Code resends without
``output_config.effort`` on Anthropic's words for a model without it, and inlines its deferred tools when
``defer_loading`` is refused; Codex CLI's hosted ``web_search`` tool is dropped (``tool_choice`` "auto") and
named in a header. Only ``max_tokens`` is lowered, so that each answer is a few tokens.

Besides: the context-length refusal in the words Claude Code reads to resend with a smaller ``max_tokens``
(its own pattern) or to compact, and a ``max_tokens`` past the context's end generated up to that end.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tokenmill.server.app import build_app
from tokenmill.server.async_engine import AsyncEngine

FIXTURES = Path(__file__).parent / "agent_requests"
EFFORT_REFUSAL = "This model does not support the effort parameter."
# the pattern Claude Code matches on a 400 to resend with max_tokens = limit - input - 1000
CLAUDE_CODE_OVERFLOW = re.compile(
    r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)"
)


def _captured() -> list[tuple[str, str, str, dict[str, Any]]]:
    out = []
    for path in sorted(FIXTURES.glob("*.jsonl")):
        for i, line in enumerate(path.read_text().splitlines()):
            entry = json.loads(line)
            out.append((f"{path.stem}-{i}", entry["client"], entry["path"], entry["body"]))
    return out


CAPTURED = _captured()


def _app(make_engine: Any, max_model_len: int, **app_args: Any) -> Iterator[httpx.AsyncClient]:
    async_engine = AsyncEngine(make_engine(max_model_len=max_model_len, num_kv_blocks=640), max_queue=16)
    async_engine.start()
    app = build_app(async_engine, "m", max_body_bytes=16 << 20, **app_args)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=300)
    client.app = app  # type: ignore[attr-defined]  # for the WebSocket requests (Starlette's test client)
    yield client
    async_engine.stop()


def _socket_turn(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """One ``response.create`` over the app's WebSocket: its events up to the last."""
    from starlette.testclient import TestClient

    with TestClient(client.app).websocket_connect(path) as ws:  # type: ignore[attr-defined]
        ws.send_text(json.dumps(body))
        events = [ws.receive_json()]
        while events[-1]["type"] not in (
            "response.completed",
            "response.incomplete",
            "response.failed",
            "error",
        ):
            events.append(ws.receive_json())
    return events


@pytest.fixture(scope="module")
def client(make_engine: Any) -> Iterator[httpx.AsyncClient]:
    yield from _app(make_engine, 8192)


@pytest.fixture(scope="module")
def small(make_engine: Any) -> Iterator[httpx.AsyncClient]:
    yield from _app(make_engine, 96)


@pytest.fixture(scope="module")
def small_refusing(make_engine: Any) -> Iterator[httpx.AsyncClient]:
    yield from _app(make_engine, 96, max_tokens_past_context="refuse")


def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> httpx.Response:
    return asyncio.run(client.post(path, content=json.dumps(body)))


def _events(r: httpx.Response) -> list[str]:
    """The ``event:`` names of an SSE body, or its ``data:`` payloads where it names no events."""
    kinds = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    return kinds or [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]


def test_the_fixtures_cover_the_three_clients() -> None:
    clients = {c.split()[0] for _, c, _, _ in CAPTURED}
    assert clients == {"claude-code", "codex-cli", "opencode"}
    assert {p for _, _, p, _ in CAPTURED} >= {"/v1/messages", "/v1/chat/completions"}
    assert {p for _, _, p, _ in CAPTURED} & {"/v1/responses", "ws:/v1/responses"}
    # no string value longer than the placeholder bound survives: no client's prompt text or identifiers

    def values(x: Any) -> Iterator[str]:
        if isinstance(x, dict):
            for v in x.values():
                yield from values(v)
        elif isinstance(x, list):
            for v in x:
                yield from values(v)
        elif isinstance(x, str):
            yield x

    assert max(len(s) for _, _, _, body in CAPTURED for s in values(body)) <= 40


@pytest.mark.parametrize(("name", "agent", "path", "body"), CAPTURED, ids=[c[0] for c in CAPTURED])
def test_captured_request(
    client: httpx.AsyncClient, name: str, agent: str, path: str, body: dict[str, Any]
) -> None:
    body = {**body, "model": "m"}
    if path.endswith("/v1/responses"):
        body["max_output_tokens"] = 8
    else:
        body["max_tokens"] = 8
    if path.startswith("ws:"):  # Codex CLI's first transport: the Responses API's WebSocket mode
        events = _socket_turn(client, path.removeprefix("ws:"), body)
        assert events[0]["type"] == "response.created", events[-1]
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
        return
    r = _post(client, path, body)
    if path == "/v1/messages":
        deferred = [i for i, t in enumerate(body.get("tools", [])) if t.get("defer_loading")]
        if (body.get("output_config") or {}).get("effort") is not None:
            assert r.status_code == 400, r.text
            assert r.json() == {
                "type": "error",
                "error": {"type": "invalid_request_error", "message": EFFORT_REFUSAL},
            }
        elif deferred:
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"].startswith(f"tools.{deferred[0]}.defer_loading")
        else:
            assert r.status_code == 200, r.text
            kinds = _events(r)
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
        return
    assert r.status_code == 200, r.text
    if path == "/v1/responses":
        hosted = [t["type"] for t in body.get("tools", []) if t["type"] not in ("function", "namespace")]
        assert r.headers.get("x-tokenmill-dropped-tools", "").split(",") == hosted
        kinds = _events(r)
        assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    else:
        chunks = _events(r)
        assert chunks[-1] == "[DONE]"
        assert json.loads(chunks[-2])["usage"]["completion_tokens"] >= 1  # stream_options.include_usage


def test_claude_code_reads_the_context_refusal(small_refusing: httpx.AsyncClient) -> None:
    """Under ``--max-tokens-past-context refuse``: prompt + max_tokens past the context is Anthropic's
    wording, whose numbers Claude Code parses; a prompt past the context alone is "prompt is too long"."""
    body = {"model": "m", "max_tokens": 200, "messages": [{"role": "user", "content": "Hello there"}]}
    r = _post(small_refusing, "/v1/messages", body)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    match = CLAUDE_CODE_OVERFLOW.search(r.json()["error"]["message"])
    assert match is not None, r.text
    num_input, num_max, limit = (int(g) for g in match.groups())
    assert (num_max, limit) == (200, 96) and 0 < num_input < 96
    count = _post(small_refusing, "/v1/messages/count_tokens", {k: body[k] for k in ("model", "messages")})
    assert count.json()["input_tokens"] == num_input  # the same count the refusal gave
    long = {**body, "max_tokens": 4, "messages": [{"role": "user", "content": "word " * 200}]}
    r = _post(small_refusing, "/v1/messages", long)
    assert r.status_code == 400
    assert re.fullmatch(r"prompt is too long: \d+ tokens > 96 maximum", r.json()["error"]["message"]), r.text
    # OpenAI's routes keep OpenAI's words
    r = _post(small_refusing, "/v1/chat/completions", {"messages": body["messages"], "max_tokens": 200})
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_max_tokens_past_the_context_generates_to_its_end(small: httpx.AsyncClient) -> None:
    """The default: a prompt that fits gets at most what the context has left, finish_reason "length"
    (opencode asks for 32,000 tokens of a model it does not know)."""
    messages = [{"role": "user", "content": "Tell me a long story."}]
    r = _post(small, "/v1/chat/completions", {"messages": messages, "max_tokens": 32000, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 96
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = _post(small, "/v1/messages", {"model": "m", "max_tokens": 32000, "messages": messages})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["input_tokens"] + usage["output_tokens"] <= 96
    r = _post(small, "/v1/completions", {"prompt": "word " * 200, "max_tokens": 4})
    assert r.json()["error"]["code"] == "context_length_exceeded"  # a prompt that cannot fit is still refused
