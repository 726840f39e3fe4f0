"""The Responses API's WebSocket mode against a real server on the embedded model, with the openai SDK's own
client (``client.responses.connect()``) as the reference: events as the HTTP stream sends them, a store-less
response continued on its socket, refusals as ``error`` events that leave the socket open, the API key checked
at the handshake, and the connection released when the socket closes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import websockets.sync.client
from serverproc import ServerProcess

KEY = "sk-socket"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--api-key", KEY, "--max-connections-per-client", "4").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _turn(conn: Any, **body: Any) -> list[Any]:
    """One response.create and the events up to its end (or an error event)."""
    conn.send({"type": "response.create", **body})
    out = []
    for event in conn:
        out.append(event)
        if event.type in ("response.completed", "response.incomplete", "response.failed", "error"):
            return out
    raise AssertionError(f"the socket closed after {[e.type for e in out]}")


def test_turns_on_one_socket(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    with client.responses.connect() as conn:
        first = _turn(conn, model=model, input="Name a colour.", max_output_tokens=8, store=False)
        kinds = [e.type for e in first]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] in ("response.completed", "response.incomplete")
        assert [e.sequence_number for e in first] == list(range(len(first)))
        done = first[-1].response
        text = "".join(e.delta for e in first if e.type == "response.output_text.delta")
        assert done.output[0].content[0].text == text and done.store is False
        # a store-less response continues on its own socket, sending only the new item
        second = _turn(
            conn,
            model=model,
            previous_response_id=done.id,
            input="And another?",
            max_output_tokens=8,
            store=False,
        )
        assert second[-1].type in ("response.completed", "response.incomplete"), [e.type for e in second]
        # the earlier turn is in the prompt: more input tokens than the new item alone
        assert second[-1].response.usage.input_tokens > done.usage.input_tokens
        # a refusal is an error event; the socket stays open for the next turn
        refused = _turn(conn, model=model, input="hi", temperature=7)
        assert refused[-1].type == "error" and refused[-1].param == "temperature"
        missing = _turn(conn, model=model, input="hi", previous_response_id="resp_unknown")
        assert missing[-1].type == "error" and missing[-1].code == "previous_response_not_found"
        third = _turn(conn, model=model, input="Hi", max_output_tokens=2)
        assert third[-1].type in ("response.completed", "response.incomplete")
    # a stored one is there for HTTP, and not the store-less one
    assert client.responses.retrieve(third[-1].response.id).id == third[-1].response.id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(done.id)


def test_a_warm_up_prefills_and_the_next_turn_reads_the_cache(client: openai.OpenAI) -> None:
    """``generate: false`` (Codex CLI's first message): the prompt's prefill only, no output; the same prompt
    next is served from the prefix cache."""
    model = client.models.list().data[0].id
    prompt = "You are a careful assistant. " * 12 + "Say one word."
    with client.responses.connect() as conn:
        warm = _turn(conn, model=model, input=prompt, generate=False, store=False)
        assert warm[-1].type == "response.completed", [e.type for e in warm]
        assert warm[-1].response.output == [] and warm[-1].response.usage.output_tokens == 0
        assert not any(e.type == "response.output_text.delta" for e in warm)
        real = _turn(conn, model=model, input=prompt, max_output_tokens=4, store=False)
        usage = real[-1].response.usage
        assert usage.input_tokens_details.cached_tokens >= 16 * (usage.input_tokens // 16) - 16


def test_the_key_is_checked_at_the_handshake(server: ServerProcess) -> None:
    url = f"ws://127.0.0.1:{server.port}/v1/responses"
    with pytest.raises(websockets.exceptions.InvalidStatus) as info:
        websockets.sync.client.connect(url, additional_headers={"Authorization": "Bearer wrong"})
    assert info.value.response.status_code == 403


def test_sockets_are_released_when_closed(server: ServerProcess) -> None:
    """Past --max-connections-per-client 4, opened and closed one after another: each close gives its place back."""
    url = f"ws://127.0.0.1:{server.port}/v1/responses"
    for _ in range(12):
        with websockets.sync.client.connect(url, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            ws.send(json.dumps({"type": "response.create", "input": "x", "stream": False}))
            assert json.loads(ws.recv(timeout=30))["param"] == "stream"
