"""Bytes at once: a stream opens before the prefill ends and sends the API's keep-alive while nothing else comes."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from tokenmill.outputs import RequestDelta
from tokenmill.server.respond import SSE_COMMENT_KEEPALIVE, events, with_keepalives


class SlowGroup:
    """One choice whose first token comes after ``first_s`` (a long prefill), then two more at once."""

    def __init__(self, first_s: float) -> None:
        self.first_s = first_s
        self.request_ids = ["r0"]
        self.aborted = False

    async def stream(self) -> AsyncIterator[tuple[int, RequestDelta]]:
        await asyncio.sleep(self.first_s)
        yield 0, RequestDelta("r0", [5], "a", False, None, num_prompt_tokens=9000)
        yield 0, RequestDelta("r0", [6], "b", True, "length", num_prompt_tokens=9000)

    def abort(self) -> None:
        self.aborted = True


class PlainView:
    def opening_events(self, num_choices: int) -> list[str]:
        return ["event: open\n\n"]

    def keepalive_event(self) -> str:
        return SSE_COMMENT_KEEPALIVE

    def event(self, index: int, delta: RequestDelta) -> str:
        return f"data: {delta.new_text}\n\n"

    def closing_events(self, num_completion_tokens: int, metrics: Any = None) -> list[str]:
        return [f"data: done {num_completion_tokens}\n\n"]

    def error_events(self, error: Any) -> list[str]:
        return ["data: error\n\n"]


def _timed(first_s: float, keepalive_s: float) -> list[tuple[float, str]]:
    from types import SimpleNamespace

    state = SimpleNamespace(async_engine=SimpleNamespace(alive=True), enable_per_request_metrics=False)

    async def go() -> list[tuple[float, str]]:
        t0 = time.perf_counter()
        out = []
        async for event in events(PlainView(), SlowGroup(first_s), state, keepalive_s=keepalive_s):  # type: ignore[arg-type]
            out.append((time.perf_counter() - t0, event))
        return out

    return asyncio.run(go())


def test_the_opening_comes_at_once_and_keepalives_fill_a_long_prefill() -> None:
    timed = _timed(first_s=1.2, keepalive_s=0.2)
    texts = [e for _, e in timed]
    assert texts[0] == "event: open\n\n" and timed[0][0] < 0.1
    first_token = texts.index("data: a\n\n")
    keepalives = [t for t, e in timed[:first_token] if e == SSE_COMMENT_KEEPALIVE]
    assert len(keepalives) >= 4  # one per 0.2 s of the 1.2 s wait
    gaps = [b - a for a, b in zip([0.0, *keepalives], keepalives)]
    assert max(gaps) < 0.45  # never silent much longer than the interval
    assert texts[first_token:] == ["data: a\n\n", "data: b\n\n", "data: done 2\n\n"]


def test_no_keepalive_when_tokens_flow() -> None:
    texts = [e for _, e in _timed(first_s=0.0, keepalive_s=0.5)]
    assert SSE_COMMENT_KEEPALIVE not in texts


def test_a_consumer_that_stops_cancels_the_pending_read() -> None:
    cancelled = asyncio.Event()

    async def never() -> AsyncIterator[int]:
        try:
            await asyncio.sleep(3600)
            yield 1
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def go() -> None:
        stream = with_keepalives(never(), 0.05)
        assert await stream.__anext__() is None  # a keep-alive
        await stream.aclose()  # the client left
        await asyncio.wait_for(cancelled.wait(), 1.0)

    asyncio.run(go())


def test_messages_stream_opens_with_message_start_and_pings() -> None:
    """Through the app on a fake engine: message_start (the prompt counted as input) and a ping come first."""
    import httpx
    from test_async_engine import FakeEngine  # noqa: I001

    from tokenmill.server.app import build_app
    from tokenmill.server.async_engine import AsyncEngine

    ae = AsyncEngine(FakeEngine(step_s=0.01))
    ae.start()
    try:
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=build_app(ae, "fake-model")), base_url="http://t"
        )
        body = {"model": "fake-model", "max_tokens": 3, "stream": True,
                "messages": [{"role": "user", "content": "hello there"}]}  # fmt: skip
        text = asyncio.run(client.post("/v1/messages", json=body)).text
    finally:
        ae.stop()
    frames = [f for f in text.split("\n\n") if f]
    kinds = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-1] == "message_stop"
    start = json.loads(frames[0].split("data: ", 1)[1])
    assert start["message"]["usage"]["input_tokens"] > 0 and start["message"]["usage"]["output_tokens"] == 0
    delta = json.loads(frames[-2].split("data: ", 1)[1])
    assert delta["usage"]["output_tokens"] == 3
