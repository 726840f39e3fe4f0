"""Two data-parallel replicas on Ray Serve on this machine (``tokenmill serve --ray``): the openai SDK's chat and
streaming through Serve's proxy, requests spread over both replicas (the ``x-tokenmill-replica`` header), and a
replica killed mid-stream failing only its own streams while the other's finish."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serverproc import ServerProcess

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow  # a Ray cluster and two model copies on two cores


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    store = tmp_path_factory.mktemp("store") / "responses.sqlite3"
    proc = ServerProcess(
        "--ray",
        "--num-replicas",
        "2",
        "--num-cpus-per-replica",
        "0.5",
        "--response-store",
        f"sqlite:{store}",
        module="tokenmill.serving.ray_serve",
    ).start(timeout_s=300)
    try:
        yield proc
    finally:
        proc.stop()


def _tag(server: ServerProcess) -> str:
    r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text
    return r.headers["x-tokenmill-replica"]


def test_openai_chat_and_streaming_through_serve(ray_server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{ray_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count to five."}], max_tokens=12, stream=True,
        temperature=0,
    ))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_requests_spread_over_both_replicas(ray_server: ServerProcess) -> None:
    counts: Counter[str] = Counter()
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(4):
            tag = _tag(ray_server)
            with lock:
                counts[tag] += 1

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(counts.values()) == 24
    assert len(counts) == 2, counts  # per-replica counts: both served


def _stream(server: ServerProcess, results: dict[int, Any], i: int, started: threading.Event) -> None:
    body = {"prompt": f"Story {i}:", "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
    outcome: dict[str, Any] = {"tag": None, "done": False, "chunks": 0, "error": None}
    results[i] = outcome
    try:
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120) as r:
            outcome["tag"] = r.headers.get("x-tokenmill-replica")
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    outcome["done"] = True
                elif line.startswith("data: "):
                    payload = json.loads(line[6:])
                    if "error" in payload:
                        outcome["error"] = payload["error"]
                    outcome["chunks"] += 1
                    if outcome["chunks"] == 2:
                        started.set()
    except httpx.HTTPError as exc:
        outcome["error"] = repr(exc)


def _continue_a_response(server: ServerProcess) -> bool:
    """Store a response, continue it by its id; whether the two requests were served by different replicas."""
    url = f"{server.base_url}/v1/responses"
    first = httpx.post(url, json={"input": "Say hi", "max_output_tokens": 2}, timeout=120)
    assert first.status_code == 200, first.text
    then = httpx.post(url, json={"input": "Again", "previous_response_id": first.json()["id"],
                                 "max_output_tokens": 2}, timeout=120)  # fmt: skip
    assert then.status_code == 200, then.text
    return first.headers["x-tokenmill-replica"] != then.headers["x-tokenmill-replica"]


def _continue_concurrently(server: ServerProcess, num_clients: int, num_pairs: int) -> list[bool]:
    """``num_clients`` at once, each continuing ``num_pairs`` responses: whether each pair crossed replicas."""
    outcomes: list[bool] = []
    lock = threading.Lock()

    def client() -> None:
        for _ in range(num_pairs):
            crossed = _continue_a_response(server)
            with lock:
                outcomes.append(crossed)

    threads = [threading.Thread(target=client) for _ in range(num_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outcomes) == num_clients * num_pairs  # every continuation found its response
    return outcomes


def test_a_previous_response_id_continues_on_whichever_replica_serves_it(ray_server: ServerProcess) -> None:
    """The replicas share one store: a response stored by one replica is continued by the other. Six clients at
    once, as in the spreading test (requests one at a time may all be routed to the same replica), in rounds until
    two pairs have crossed: Serve's router decides where each goes."""
    crossed = 0
    for _ in range(5):
        crossed += sum(_continue_concurrently(ray_server, num_clients=6, num_pairs=4))
        if crossed >= 2:
            break
    assert crossed >= 2


def test_a_replica_killed_mid_stream_fails_only_its_own_requests(ray_server: ServerProcess) -> None:
    results: dict[int, Any] = {}
    events = [threading.Event() for _ in range(6)]
    threads = [threading.Thread(target=_stream, args=(ray_server, results, i, events[i])) for i in range(6)]
    for t in threads:
        t.start()
    for e in events:
        assert e.wait(120), "a stream never started"
    tags = Counter(r["tag"] for r in results.values())
    assert len(tags) == 2, f"six concurrent streams all went to one replica: {tags}"
    victim = min(tags)  # one replica's process
    os.kill(int(victim.rsplit("/", 1)[1]), signal.SIGKILL)
    for t in threads:
        t.join(180)
    for r in results.values():
        if r["tag"] == victim:
            assert not r["done"], "a stream of the killed replica claims to have finished"
        else:
            assert r["done"] and r["error"] is None, r  # the other replica's streams run to the end
