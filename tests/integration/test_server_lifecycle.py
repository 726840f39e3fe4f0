"""Nothing lost, nothing leaked: disconnects abort within a step, a 64-request burst drains to a whole
pool, and SIGTERM finishes or aborts what is in flight with a terminal answer, then exits 0.

The SIGTERM test stops this module's server, so it runs last (pytest keeps file order).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from serverproc import ServerProcess

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    # a context long enough that the long stream below cannot finish within the 3 s deadline on a fast CPU
    proc = ServerProcess(
        "--max-num-seqs", "64", "--shutdown-timeout", "3", "--max-model-len", "4096", "--num-kv-blocks", "600"
    ).start()  # fmt: skip
    yield proc
    proc.stop()


def _wait_idle(server: ServerProcess, within_s: float) -> float:
    """Seconds until nothing runs and the pool is empty; fails after ``within_s``."""
    start = time.monotonic()
    while True:
        m = server.metrics()
        running = m['vllm:num_requests_running{model_name="SmolLM2-135M-Instruct"}']
        usage = m['vllm:kv_cache_usage_perc{model_name="SmolLM2-135M-Instruct"}']
        in_flight = m['tokenmill:num_requests_in_flight{model_name="SmolLM2-135M-Instruct"}']
        if running == 0 and usage == 0 and in_flight == 0:
            return time.monotonic() - start
        assert time.monotonic() - start < within_s, f"running={running} usage={usage} in_flight={in_flight}"
        time.sleep(0.05)


def _aborted(server: ServerProcess) -> float:
    return server.metrics()[
        'vllm:request_success_total{model_name="SmolLM2-135M-Instruct",finished_reason="abort"}'
    ]


def test_stream_disconnect_aborts_within_a_second(server: ServerProcess) -> None:
    aborted_before = _aborted(server)
    body = {"prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events: list[str] = []
        lines = r.iter_lines()  # held: dropping a half-read iterator would close the connection here
        for line in lines:
            if line.startswith("data: "):
                events.append(line)
            if len(events) == 3:
                break
        assert server.metric("vllm:num_requests_running") == 1
        assert server.metric("vllm:kv_cache_usage_perc") > 0
    # leaving the block closed the connection mid-stream
    assert _wait_idle(server, within_s=1.0) <= 1.0
    assert _aborted(server) == aborted_before + 1


def test_non_streaming_disconnect_aborts(server: ServerProcess) -> None:
    aborted_before = _aborted(server)
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
    assert _wait_idle(server, within_s=1.0) <= 1.0
    assert _aborted(server) == aborted_before + 1


def test_burst_of_64_streams_completes_and_pool_is_whole(server: ServerProcess) -> None:
    num_requests, max_tokens = 64, 8

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, int, int]:
        body = {
            "prompt": f"{PROMPT} number {i}",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.7,
            "seed": i,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        num_text_chunks = 0
        usage_tokens = -1
        num_done = 0
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: ") :]
                if payload == "[DONE]":
                    num_done += 1
                    continue
                chunk = json.loads(payload)
                assert "error" not in chunk, chunk
                if chunk["choices"]:
                    num_text_chunks += 1
                elif chunk.get("usage"):
                    usage_tokens = chunk["usage"]["completion_tokens"]
        return num_text_chunks, usage_tokens, num_done

    async def burst() -> list[tuple[int, int, int]]:
        limits = httpx.Limits(max_connections=num_requests)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(num_requests)))

    success_before = server.metrics()[
        'vllm:request_success_total{model_name="SmolLM2-135M-Instruct",finished_reason="length"}'
    ]
    results = asyncio.run(burst())
    assert all(usage == max_tokens for _, usage, _ in results), results
    assert all(done == 1 for _, _, done in results)
    assert all(1 <= chunks <= max_tokens for chunks, _, _ in results)
    _wait_idle(server, within_s=5.0)
    m = server.metrics()
    label = '{model_name="SmolLM2-135M-Instruct"}'
    assert m[f"tokenmill:kv_free_blocks{label}"] == m[f"tokenmill:kv_total_blocks{label}"]
    after = m['vllm:request_success_total{model_name="SmolLM2-135M-Instruct",finished_reason="length"}']
    assert after - success_before == num_requests
    assert m[f"vllm:time_to_first_token_seconds_count{label}"] >= num_requests
    assert m[f"tokenmill:batch_occupancy{label}"] > 0
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_sigterm_finishes_or_aborts_in_flight_then_exits(server: ServerProcess) -> None:
    """A short request finishes normally, a long one is aborted at the deadline with an error event and
    [DONE]; new connections are refused; the process exits 0."""
    results: dict[str, list[str]] = {}
    started = {name: threading.Event() for name in ("short", "long")}

    def stream(name: str, max_tokens: int) -> None:
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        events: list[str] = []
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    started[name].set()
        results[name] = events

    threads = [
        threading.Thread(target=stream, args=("short", 6)),
        threading.Thread(target=stream, args=("long", 4000)),
    ]
    for t in threads:
        t.start()
    for event in started.values():
        assert event.wait(60)
    server.terminate()
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.base_url}/health", timeout=2)
    for t in threads:
        t.join(30)
    assert server.proc is not None
    assert server.proc.wait(30) == 0

    short = results["short"]
    assert short[-1] == "[DONE]" and short.count("[DONE]") == 1
    assert json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    long = results["long"]
    assert long[-1] == "[DONE]" and long.count("[DONE]") == 1
    last = json.loads(long[-2])
    assert "error" in last and last["error"]["type"] == "server_error"
    assert len(long) < 4000
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", server.port), timeout=1):
        pass
