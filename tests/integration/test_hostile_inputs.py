"""Hostile constraints and text through every route that takes them, on the embedded model in process: each
is a 400 naming the limit and the field, never a crash or a 500, and the server answers afterwards.

The reproducers: a JSON schema whose ``$ref``s chain 1,000 nested object definitions (llguidance's compiler
recursed past an 8 MiB stack on ~700 and killed the process), a Lark grammar of 5,000 chained rules (the
same at ~2,500), regexes with nested counted repetition or a megabyte of text, a grammar whose language is
empty, a schema nested 2,000 deep inside a string, and a lone surrogate in every text field."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tokenmill.server.app import build_app
from tokenmill.server.async_engine import AsyncEngine


def ref_chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {
        f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)
    }
    defs[f"d{n}"] = {"type": "string"}
    return {"type": "object", "properties": {"a": {"$ref": "#/$defs/d0"}}, "$defs": defs}


def lark_chain(n: int) -> str:
    rules = "\n".join(f'r{i}: "a" r{i + 1}' for i in range(n))
    return f'start: r0\n{rules}\nr{n}: "b"\n'


def deep_string_schema(n: int) -> str:
    return '{"type": "object", "properties": {"a": ' * n + '{"type": "string"}' + "}}" * n


M = [{"role": "user", "content": "hi"}]
CHAIN = ref_chain(1_000)
TOOL = {"type": "function", "function": {"name": "f", "parameters": CHAIN}}

# (path, body, the field the 400 names)
SCHEMA_PLACES: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", {"messages": M, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": CHAIN}}}, "response_format"),
    ("/v1/chat/completions", {"messages": M, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
    ("/v1/completions", {"prompt": "hi", "guided_json": CHAIN}, "guided_json"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": CHAIN}}}, "text.format"),
    ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": M, "output_config": {"format": {"type": "json_schema", "schema": CHAIN}}}, "output_config"),
    ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": M, "tool_choice": {"type": "any"}, "tools": [{"name": "f", "input_schema": CHAIN}]}, "tool_choice"),
]  # fmt: skip

OTHER_CONSTRAINTS: list[tuple[dict[str, Any], str]] = [
    ({"guided_grammar": lark_chain(5_000)}, "refer to each other"),
    ({"guided_regex": "((a{100}){100}){100}"}, "repeats 1000000 times"),
    ({"guided_regex": "a" * (1 << 20)}, "characters, over the limit"),
    ({"guided_json": deep_string_schema(2_000)}, "nested more than"),
    ({"guided_grammar": "start: a\na: b\nb: a"}, "its language is empty"),  # no sentence: an empty language
    ({"guided_choice": [f"c{i}" for i in range(100_000)]}, "100000 entries"),
]


@pytest.fixture(scope="module")
def client(make_engine: Any) -> Iterator[httpx.AsyncClient]:
    async_engine = AsyncEngine(make_engine(max_model_len=4096), max_queue=16)
    async_engine.start()
    app = build_app(async_engine, "m", max_body_bytes=16 << 20)
    yield httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120)
    async_engine.stop()


def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> httpx.Response:
    return asyncio.run(client.post(path, content=json.dumps(body)))


def _still_serves(client: httpx.AsyncClient) -> None:
    r = _post(client, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,body,field", SCHEMA_PLACES)
def test_a_ref_chain_of_a_thousand_definitions_is_a_400_in_every_place(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], field: str
) -> None:
    r = _post(client, path, body)
    assert r.status_code == 400, r.text
    text = r.text
    assert "levels deep through nesting and $ref" in text and "limit of 1000" in text
    if path != "/v1/messages":
        assert r.json()["error"]["param"].startswith(field)
    _still_serves(client)


@pytest.mark.parametrize("fields,message", OTHER_CONSTRAINTS, ids=lambda v: str(v)[:40])
def test_hostile_grammars_regexes_and_choices_are_400s(
    client: httpx.AsyncClient, fields: dict[str, Any], message: str
) -> None:
    r = _post(client, "/v1/completions", {"prompt": "hi", "max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == next(iter(fields))
    assert "backtrace" not in error["message"] and "\n" not in error["message"]
    _still_serves(client)


S = "\ud800"  # a lone surrogate: JSON's escapes spell it ("\\ud800"), UTF-8 cannot
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": "\\ud800"}'}}
SURROGATES: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": S}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": S}]}]}, "messages[0].content[0].text"),
    ("/v1/chat/completions", {"messages": [*M, {"role": "assistant", "tool_calls": [CALL]}]}, "messages"),
    ("/v1/chat/completions", {"messages": M, "stop": [S]}, "stop[0]"),
    ("/v1/completions", {"prompt": S}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", S]}, "prompt[1]"),
    ("/v1/responses", {"input": S}, "input"),
    ("/v1/responses", {"input": "hi", "instructions": S}, "instructions"),
    ("/v1/responses", {"input": "hi", "user": S}, "user"),
    ("/v1/responses", {"input": "hi", "metadata": {"k": S}}, "metadata.k"),
    ("/v1/responses", {"input": "hi", "metadata": {S: "v"}}, "metadata." + S),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": S}]}, "messages[0].content"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": M, "system": S}, "system"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [*M, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"a": S}}]}]}, "messages[1].content[0].input.a"),
    ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": S}]}, "messages[0].content"),
    ("/tokenize", {"prompt": S}, "prompt"),
    ("/detokenize", {"tokens": [1], "model": S}, "model"),
]  # fmt: skip


@pytest.mark.parametrize("path,body,field", SURROGATES, ids=lambda v: v if isinstance(v, str) else "")
def test_a_lone_surrogate_is_a_400_naming_its_field(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], field: str
) -> None:
    raw = json.dumps(body)  # ensure_ascii: the surrogate travels as the escape "\ud800"
    assert "\\ud800" in raw
    r = asyncio.run(client.post(path, content=raw))
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"] if path != "/v1/messages" else r.json()["error"]["message"]
    assert "not valid Unicode" in message
    if path not in ("/v1/messages", "/v1/messages/count_tokens"):
        expected = field.encode("utf-8", "backslashreplace").decode()
        assert r.json()["error"]["param"] == expected


SMALL_400S: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", {"messages": M, "temperature": 1e308}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 2.5}, "temperature"),
    ("/v1/responses", {"input": "x", "temperature": 1e308}, "temperature"),
    ("/v1/responses", {"input": "x", "background": 0}, "background"),
    ("/v1/responses", {"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ("/v1/responses", {"input": "x", "metadata": {"k" * 65: "v"}}, "metadata"),
    ("/v1/responses", {"input": "x", "metadata": {"k": "v" * 513}}, "metadata.k"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": M, "temperature": 1.5}, "temperature"),
]  # fmt: skip


@pytest.mark.parametrize("path,body,field", SMALL_400S, ids=lambda v: v if isinstance(v, str) else "")
def test_out_of_range_fields_are_400s(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], field: str
) -> None:
    r = _post(client, path, body)
    assert r.status_code == 400, r.text
    if path != "/v1/messages":
        assert r.json()["error"]["param"] == field
    else:
        assert field in r.json()["error"]["message"]


def test_input_items_limit_takes_ascii_digits_only(client: httpx.AsyncClient) -> None:
    r = _post(client, "/v1/responses", {"input": "Hi", "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    response_id = r.json()["id"]
    for limit in ("²", "٣", "9" * 5000, "-1", "0", "101"):
        got = asyncio.run(client.get(f"/v1/responses/{response_id}/input_items", params={"limit": limit}))
        assert got.status_code == 400 and got.json()["error"]["param"] == "limit", (limit[:8], got.text[:200])
    ok = asyncio.run(client.get(f"/v1/responses/{response_id}/input_items", params={"limit": "3"}))
    assert ok.status_code == 200


def test_an_incomplete_response_says_so_on_its_message_too(client: httpx.AsyncClient) -> None:
    r = _post(client, "/v1/responses", {"input": "Count to twenty", "max_output_tokens": 2, "temperature": 0})
    body = r.json()
    assert body["status"] == "incomplete"
    assert [item["status"] for item in body["output"] if item["type"] == "message"] == ["incomplete"]


def _big_schema(seed: int, num_properties: int = 400) -> dict[str, Any]:
    props = {f"field_{seed}_{i}": {"type": "string", "description": "d" * 200} for i in range(num_properties)}
    return {"type": "object", "properties": props}


def test_the_grammar_cache_stays_under_its_byte_bound(make_engine: Any) -> None:
    """100 distinct large schemas (~100 KB each): the cache evicts the oldest and keeps its bound, and
    /metrics says so."""
    engine = make_engine(max_model_len=512)
    compiler = engine.structured_outputs()
    compiler.cache.max_bytes = 2 << 20
    from tokenmill.sampling_params import StructuredOutputsParams

    for seed in range(100):
        compiler.compile(StructuredOutputsParams(json=_big_schema(seed)))
        assert compiler.cache.num_bytes <= compiler.cache.max_bytes
    assert compiler.cache.num_evicted > 50 and 0 < len(compiler.cache) < 50
    assert compiler.cache.num_misses == 100
    compiler.compile(StructuredOutputsParams(json=_big_schema(99)))
    assert compiler.cache.num_hits == 1


def test_constraints_compile_off_the_engine_thread_and_a_slow_one_holds_nobody(
    make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compile runs on its own thread; one that takes seconds lets another request finish meanwhile, and
    one past the time budget is refused while its thread is left to finish."""
    import threading
    import time

    from tokenmill.structured_outputs import StructuredOutputs

    engine = make_engine(max_model_len=512)
    compiler = engine.structured_outputs()
    threads: list[str] = []
    release = threading.Event()
    build = StructuredOutputs._build

    def slow_build(self: StructuredOutputs, params: Any) -> Any:
        threads.append(threading.current_thread().name)
        if params.regex == "slow":
            release.wait(30)
        return build(self, params)

    monkeypatch.setattr(StructuredOutputs, "_build", slow_build)
    async_engine = AsyncEngine(engine, max_queue=16)
    async_engine.start()
    app = build_app(async_engine, "m")
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)

    async def scenario() -> tuple[int, int, list[str]]:
        slow = asyncio.create_task(
            client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "guided_regex": "slow"})
        )
        await asyncio.sleep(0.2)
        order: list[str] = []
        fast = await client.post(
            "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "guided_regex": "[a-z ]+"}
        )
        order.append("fast")
        assert not slow.done()
        release.set()
        slow_response = await slow
        order.append("slow")
        return fast.status_code, slow_response.status_code, order

    try:
        compiler.compile_timeout_s = 20.0
        fast_status, slow_status, order = asyncio.run(scenario())
        assert (fast_status, slow_status, order) == (200, 200, ["fast", "slow"])
        assert threads and set(threads) == {"tokenmill-constraint"}
        compiler.compile_timeout_s = 0.3  # now the slow one overruns and is abandoned
        release.clear()
        started = time.perf_counter()
        r = asyncio.run(
            client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "guided_regex": "slow"})
        )
        assert r.status_code == 400 and "ran over the 0.3 s limit" in r.json()["error"]["message"]
        assert time.perf_counter() - started < 10  # not waited for (it would hold 30 s)
        assert compiler.num_compile_timeouts == 1
        ok = asyncio.run(client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}))
        assert ok.status_code == 200
        metrics = asyncio.run(client.get("/metrics")).text
        assert "tokenmill:constraint_compile_timeouts_total" in metrics
    finally:
        release.set()
        compiler.compile_timeout_s = 5.0
        async_engine.stop()


HUGE = "word " * 1_000_000  # 5 MB: no prompt of a 512-token context
TOO_LONG: list[tuple[str, dict[str, Any]]] = [
    ("/tokenize", {"prompt": HUGE}),
    ("/tokenize", {"messages": [{"role": "user", "content": HUGE}]}),
    ("/v1/messages/count_tokens", {"model": "m", "messages": M, "system": HUGE}),
    ("/v1/completions", {"prompt": HUGE, "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE}], "max_tokens": 1}),
    ("/v1/responses", {"input": HUGE, "max_output_tokens": 1}),
]


@pytest.mark.parametrize("path,body", TOO_LONG, ids=lambda v: v if isinstance(v, str) else "")
def test_text_no_context_could_hold_is_refused_before_tokenizing(
    client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> None:
    r = _post(client, path, body)
    assert r.status_code == 400, r.text[:300]
    assert "cannot fit this model's context of 4096 tokens" in r.text  # the check before the tokenizer


def test_preparing_a_prompt_past_its_time_budget_is_abandoned(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenmill.server import common

    monkeypatch.setattr(common, "TEXT_BUDGET_S", 1e-9)
    for path, body in (("/tokenize", {"prompt": "word " * 2000}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 2000}]})):  # fmt: skip
        r = _post(client, path, body)
        assert r.status_code == 400 and "ran over the 1e-09 s limit" in r.text, r.text[:200]
    monkeypatch.undo()
    _still_serves(client)


def test_a_lone_surrogate_in_the_path_is_a_4xx(client: httpx.AsyncClient) -> None:
    for path in (
        "/v1/responses/%ED%A0%80",
        "/v1/responses/resp_%ED%A0%80/input_items",
        "/v1/models/%ED%A0%80",
    ):
        r = asyncio.run(client.get(path))
        assert 400 <= r.status_code < 500, (path, r.status_code, r.text[:200])
