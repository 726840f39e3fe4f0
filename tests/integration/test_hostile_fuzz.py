"""Fuzzing every constraint-taking place of every POST route with generated schemas, grammars and regexes of
growing size (``$ref`` chains and cycles, rule chains, nesting, counted repetitions) and text with lone
surrogates, through the ASGI app over the embedded model: no answer is a 5xx and ``/health`` answers after
each. Fixed seed, bounded count. The slow variant sends the same kinds to a real ``tokenmill serve`` process
and checks that it lives, and that no request and no KV block is left in use."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.server.app import build_app
from tokenmill.server.async_engine import AsyncEngine

TYPES = st.sampled_from(["string", "integer", "number", "boolean", "null", "object", "array"])


@st.composite
def schemas(draw: st.DrawFn) -> dict[str, Any]:
    """A JSON schema with definitions that refer to each other (chains, cycles, self-references), nested
    objects and arrays, enums and unions, of a size drawn from small to past the limits."""
    num_defs = draw(st.sampled_from([0, 1, 3, 20, 200, 1_200]))
    names = [f"d{i}" for i in range(num_defs)]

    def node(depth: int) -> dict[str, Any]:
        kind = draw(st.integers(0, 6))
        if depth <= 0 or kind == 0:
            return {"type": draw(TYPES)}
        if kind == 1 and names:
            return {"$ref": f"#/$defs/{draw(st.sampled_from(names))}"}
        if kind == 2:
            return {
                "type": "object",
                "properties": {f"p{i}": node(depth - 1) for i in range(draw(st.integers(0, 3)))},
            }
        if kind == 3:
            return {"type": "array", "items": node(depth - 1)}
        if kind == 4:
            return {"anyOf": [node(depth - 1) for _ in range(draw(st.integers(1, 3)))]}
        if kind == 5:
            return {"enum": list(range(draw(st.sampled_from([1, 5, 20_000]))))}
        return {"$ref": "#"}

    depth = draw(st.sampled_from([1, 3, 8]))
    defs = {}
    chain = draw(st.booleans())
    for i, name in enumerate(names):
        if chain and i + 1 < num_defs:  # a chain through nested objects: the shape that overflowed a stack
            defs[name] = {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}}
        else:
            defs[name] = node(min(depth, 2))
    root = node(depth)
    if names:
        root = {"type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}, "y": root}, "$defs": defs}
    wrap = draw(st.sampled_from([0, 0, 30, 70]))  # nested past the document's limit, sometimes
    for _ in range(wrap):
        root = {"type": "object", "properties": {"n": root}}
    return root


@st.composite
def grammars(draw: st.DrawFn) -> str:
    num_rules = draw(st.sampled_from([1, 5, 50, 3_000, 12_000]))
    lines = ["start: r0"]
    for i in range(num_rules):
        refs = [f"r{j}" for j in draw(st.lists(st.integers(0, num_rules - 1), max_size=2))]
        if draw(st.booleans()) and i + 1 < num_rules:
            refs.append(f"r{i + 1}")  # a chain
        opens = draw(st.sampled_from([0, 1, 3, 80]))
        atom = draw(st.sampled_from(['"a"', "/[a-z]{1,3}/", '"b" ~ 2', "/((x{100}){100}){100}/"]))
        body = " ".join(["(" * opens + atom + ")" * opens, *refs])
        lines.append(f'r{i}: {body} | "z"')
    return "\n".join(lines)


@st.composite
def regexes(draw: st.DrawFn) -> str:
    depth = draw(st.integers(0, 70))
    count = draw(st.sampled_from([1, 3, 100, 5_000]))
    core = draw(st.sampled_from(["a", "[a-z]", "\\d", "."]))
    return "(" * depth + core + (")" + f"{{{count}}}") * depth + "x" * draw(st.sampled_from([0, 10, 70_000]))


M = [{"role": "user", "content": "hi"}]


def placements(constraint: tuple[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    kind, value = constraint
    if kind == "schema":
        tool = {"type": "function", "function": {"name": "f", "parameters": value}}
        return [
            ("/v1/chat/completions", {"messages": M, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": value}}}),
            ("/v1/chat/completions", {"messages": M, "tools": [tool], "tool_choice": "required"}),
            ("/v1/completions", {"prompt": "x", "guided_json": json.dumps(value)}),
            ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": value}}}),
            ("/v1/messages", {"model": "m", "max_tokens": 2, "messages": M, "output_config": {"format": {"type": "json_schema", "schema": value}}}),
            ("/v1/messages", {"model": "m", "max_tokens": 2, "messages": M, "tool_choice": {"type": "any"}, "tools": [{"name": "f", "input_schema": value}]}),
        ]  # fmt: skip
    if kind == "grammar":
        return [("/v1/completions", {"prompt": "x", "guided_grammar": value}),
                ("/v1/chat/completions", {"messages": M, "structured_outputs": {"grammar": value}})]  # fmt: skip
    if kind == "regex":
        return [("/v1/completions", {"prompt": "x", "guided_regex": value}),
                ("/v1/chat/completions", {"messages": M, "structured_outputs": {"regex": value}})]  # fmt: skip
    return [("/v1/chat/completions", {"messages": [{"role": "user", "content": value}]}),
            ("/v1/completions", {"prompt": value}), ("/tokenize", {"prompt": value}),
            ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": value}]})]  # fmt: skip


CONSTRAINTS = st.one_of(
    st.tuples(st.just("schema"), schemas()),
    st.tuples(st.just("grammar"), grammars()),
    st.tuples(st.just("regex"), regexes()),
    st.tuples(
        st.just("text"), st.text(st.characters(min_codepoint=0xD700, max_codepoint=0xE000), max_size=5)
    ),
)


@pytest.fixture(scope="module")
def client(make_engine: Any) -> Iterator[httpx.AsyncClient]:
    async_engine = AsyncEngine(make_engine(max_model_len=256), max_queue=16)
    async_engine.start()
    app = build_app(async_engine, "m", max_body_bytes=16 << 20)
    yield httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120)
    async_engine.stop()


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(CONSTRAINTS, st.integers(0, 5))
def test_no_hostile_constraint_or_text_gets_a_5xx(
    client: httpx.AsyncClient, constraint: tuple[str, Any], pick: int
) -> None:
    places = placements(constraint)
    path, body = places[pick % len(places)]
    body = (
        {**body, "max_tokens": 2}
        if path not in ("/tokenize", "/v1/messages/count_tokens", "/v1/responses")
        else body
    )
    if path == "/v1/responses":
        body = {**body, "max_output_tokens": 2}

    async def go() -> tuple[httpx.Response, httpx.Response]:
        raw = json.dumps(body)  # ensure_ascii: a surrogate travels as its escape
        return await client.post(path, content=raw), await client.get("/health")

    response, health = asyncio.run(go())
    assert response.status_code < 500, (path, response.text[:300])
    assert health.status_code == 200


@pytest.fixture(scope="module")
def real_server() -> Iterator[Any]:
    from serverproc import ServerProcess

    proc = ServerProcess("--max-body-bytes", str(16 << 20)).start()
    yield proc
    proc.stop()


@pytest.mark.slow
@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(CONSTRAINTS, st.integers(0, 5))
def test_a_real_server_lives_through_hostile_constraints(
    real_server: Any, constraint: tuple[str, Any], pick: int
) -> None:
    places = placements(constraint)
    path, body = places[pick % len(places)]
    body = {**body, "max_output_tokens" if path == "/v1/responses" else "max_tokens": 2}
    if path in ("/tokenize", "/v1/messages/count_tokens"):
        body.pop("max_tokens")
    r = httpx.post(real_server.base_url + path, content=json.dumps(body), timeout=120,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code < 500, (path, r.text[:300])
    assert httpx.get(real_server.base_url + "/health", timeout=10).status_code == 200


@pytest.mark.slow
def test_the_real_server_ends_the_fuzz_with_nothing_in_use(real_server: Any) -> None:
    assert real_server.proc.poll() is None
    assert real_server.metric("vllm:num_requests_running") == 0
    assert real_server.metric("vllm:kv_cache_usage_perc") == 0
    assert "Traceback" not in real_server.output()
