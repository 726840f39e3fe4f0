"""Property-based fuzzing of every POST route against the request shapes ``/openapi.json`` publishes.

Bodies are built from each route's schema (its request model's properties, with values of the right type,
of a wrong type, or out of range, plus unknown keys and non-object bodies) and sent to the app in process
over a fake engine. Whatever arrives, the answer is never a 5xx, and every 4xx is OpenAI's error shape.
Bounded: a fixed number of examples per route, no shrinking past a deadline.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_async_engine import FakeEngine

from tokenmill.server.app import build_app
from tokenmill.server.async_engine import AsyncEngine

JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
JSON = st.recursive(
    JSON_LEAVES,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
    max_leaves=8,
)


def _value_for(prop: dict[str, Any]) -> st.SearchStrategy[Any]:
    """A value that often has the property's JSON type and sometimes anything at all."""
    kinds = {option.get("type") for option in prop.get("anyOf", [prop])}
    typed: list[st.SearchStrategy[Any]] = []
    if "string" in kinds:
        typed.append(st.text(max_size=12))
    if "integer" in kinds:
        typed.append(st.integers(-5, 300))
    if "number" in kinds:
        typed.append(st.floats(-3, 3, allow_nan=False))
    if "boolean" in kinds:
        typed.append(st.booleans())
    if "array" in kinds:
        typed.append(st.lists(st.integers(0, 60) | st.text(max_size=4), max_size=4))
    if "object" in kinds:
        typed.append(st.dictionaries(st.sampled_from(["role", "content", "1", "x"]), JSON, max_size=3))
    return st.one_of(*typed, JSON) if typed else JSON


def _bodies(schema: dict[str, Any], model: str) -> st.SearchStrategy[Any]:
    props = schema["components"]["schemas"][model]["properties"]
    fields = st.fixed_dictionaries({}, optional={name: _value_for(p) for name, p in props.items()})
    extra = st.dictionaries(st.text(max_size=6), JSON, max_size=2)
    objects = st.tuples(fields, extra).map(lambda fe: {**fe[1], **fe[0]})
    return st.one_of(objects, objects, objects, JSON)


def _app() -> tuple[Any, AsyncEngine]:
    ae = AsyncEngine(FakeEngine(), max_queue=8)
    ae.start()
    return build_app(ae, "fake-model", max_body_bytes=1 << 16), ae


APP, ENGINE = _app()
SCHEMA = APP.openapi()
ROUTES = {
    path: op["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    for path, op in SCHEMA["paths"].items()
    if "post" in op and "requestBody" in op["post"]
}


def test_every_post_route_publishes_its_body() -> None:
    assert set(ROUTES) == {
        "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
        "/v1/embeddings", "/tokenize", "/detokenize",
    }  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_no_request_body_gets_a_server_error(data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(sorted(ROUTES)))
    body = data.draw(_bodies(SCHEMA, ROUTES[path]))

    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=APP)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(path, json=body, timeout=10)

    response = asyncio.run(send())
    assert response.status_code < 500, (path, body, response.text)
    if response.status_code >= 400 and path.startswith("/v1/messages"):  # Anthropic's shape
        body_out = response.json()
        assert body_out["type"] == "error" and set(body_out["error"]) == {"type", "message"}, body_out
    elif response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
    assert ENGINE.alive
