"""The async bridge and the app's routes, over a scripted fake engine (no model, no sockets)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from tokenmill.errors import ContextLengthError
from tokenmill.outputs import Logprob, RequestDelta
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.app import build_app
from tokenmill.server.async_engine import (
    AsyncEngine,
    DrainingError,
    EngineDeadError,
    QueueFullError,
    collect,
)
from tokenmill.stats import EngineStats


class FakeTokenizer:
    vocab_size = 100
    eos_token_ids = frozenset({0})

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [10 + (ord(c) - ord("a")) % 26 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + (i - 10) % 26) for i in ids)

    def id_to_token(self, token_id: int) -> str:
        return self.decode([token_id])

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        return self.encode("".join(m["content"] for m in messages) or "x")


class FakeEngine:
    """Each step, every admitted request gets one token (``10 + n % 26``) until max_tokens."""

    def __init__(self, max_num_seqs: int = 8, step_s: float = 0.0, fail_at_step: int | None = None) -> None:
        self.tokenizer = FakeTokenizer()
        self.max_model_len = 64
        self.model_name = "fake"
        self.quantization = None
        self.arithmetic = "fake arithmetic"
        self.clock = time.perf_counter
        self.max_num_seqs = max_num_seqs
        self.step_s = step_s
        self.fail_at_step = fail_at_step
        self.requests: dict[str, dict[str, Any]] = {}
        self.order: list[str] = []
        self.pending: list[str] = []
        self.num_steps = 0
        self.thread_ids: set[int] = set()
        self.stats = EngineStats()
        self.num_total_blocks = 10

    def _touch(self) -> None:
        self.thread_ids.add(threading.get_ident())

    def add_request(self, prompt: Any, params: SamplingParams, request_id: str, arrival_time_s: float) -> str:
        self._touch()
        if not prompt:
            raise ValueError("prompt must not be empty")
        if len(prompt) + params.max_tokens > self.max_model_len:  # as the real scheduler's intake check
            raise ContextLengthError("prompt too long", self.max_model_len, len(prompt), params.max_tokens)
        self.requests[request_id] = {"params": params, "n": 0, "prompt": list(prompt), "admitted": False}
        self.order.append(request_id)
        return request_id

    def abort(self, request_id: str) -> bool:
        self._touch()
        if request_id not in self.requests or request_id in self.pending:
            return False
        self.pending.append(request_id)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> Any:
        self._touch()
        self.num_steps += 1
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
            raise RuntimeError("boom")
        if self.step_s:
            time.sleep(self.step_s)
        deltas, admitted = [], []
        for rid in list(self.pending):
            r = self.requests.pop(rid)
            self.order.remove(rid)
            deltas.append(RequestDelta(rid, [], "", True, "abort", num_prompt_tokens=len(r["prompt"])))
        self.pending.clear()
        for rid in self.order[: self.max_num_seqs]:
            r = self.requests[rid]
            if not r["admitted"]:
                r["admitted"] = True
                admitted.append(rid)
            tok = 10 + r["n"] % 26
            r["n"] += 1
            done = r["n"] >= r["params"].max_tokens
            lps = (
                [Logprob(tok, -0.5, [(tok, -0.5), (11, -1.5)])] if r["params"].logprobs is not None else None
            )
            deltas.append(
                RequestDelta(
                    rid,
                    [tok],
                    self.tokenizer.decode([tok]),
                    done,
                    "length" if done else None,
                    new_logprobs=lps,
                    num_prompt_tokens=len(r["prompt"]),
                    num_output_tokens=r["n"],
                )
            )
            if done:
                del self.requests[rid]
                self.order.remove(rid)
        return SimpleNamespace(deltas=deltas, record=SimpleNamespace(admitted_ids=admitted))

    @property
    def num_running(self) -> int:
        return min(len(self.order), self.max_num_seqs)

    @property
    def num_waiting(self) -> int:
        return max(0, len(self.order) - self.max_num_seqs)

    @property
    def kv_cache_usage(self) -> float:
        return 0.1 * self.num_running

    @property
    def num_free_blocks(self) -> int:
        return 10 - self.num_running

    def check_integrity(self) -> None:
        self._touch()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 10))


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine()


def test_submit_and_collect_n_choices(fake: FakeEngine) -> None:
    ae = AsyncEngine(fake, max_queue=8)
    ae.start()

    async def go() -> Any:
        group = await ae.submit([([10, 11], SamplingParams(max_tokens=3))] * 2)
        return await collect(group)

    results = run(go())
    assert [len(r.token_ids) for r in results] == [3, 3]
    assert all(r.finish_reason == "length" for r in results)
    assert results[0].text == "abc"
    assert ae.num_in_flight == 0
    ae.stop()
    assert fake.thread_ids and threading.get_ident() not in fake.thread_ids  # only the engine thread
    assert len(fake.thread_ids) == 1


def test_abort_ends_the_stream_once() -> None:
    fake = FakeEngine(step_s=0.005)
    ae = AsyncEngine(fake)
    ae.start()

    async def go() -> list[RequestDelta]:
        group = await ae.submit([([10], SamplingParams(max_tokens=50))])
        seen = []
        async for _, delta in group.stream():
            seen.append(delta)
            if len(seen) == 2:
                group.abort()
                group.abort()  # idempotent
        return seen

    seen = run(go())
    assert seen[-1].finished and seen[-1].finish_reason == "abort"
    assert sum(d.finished for d in seen) == 1
    assert len(seen) < 50
    time.sleep(0.05)
    assert not fake.requests and ae.num_in_flight == 0
    ae.stop()


def test_queue_bound_counts_waiting_not_running() -> None:
    fake = FakeEngine(max_num_seqs=1, step_s=0.01)
    ae = AsyncEngine(fake, max_queue=2)
    ae.start()
    params = SamplingParams(max_tokens=40)

    async def go() -> None:
        groups = [await ae.submit([([10], params)])]
        await asyncio.sleep(0.1)  # the first is running now
        groups.append(await ae.submit([([10], params)]))
        groups.append(await ae.submit([([10], params)]))
        with pytest.raises(QueueFullError):
            await ae.submit([([10], params)])
        with pytest.raises(QueueFullError):
            await ae.submit([([10], params)] * 2)
        with pytest.raises(ValueError, match="could never be accepted"):  # more than the whole queue: a 400
            await ae.submit([([10], params)] * 3)
        for g in groups:
            g.abort()
        for g in groups:
            await collect(g)

    run(go())
    assert ae.num_in_flight == 0
    assert 'tokenmill:queue_rejections_total{model_name="fake"} 2' in ae.metrics.render()
    ae.stop()


def test_bad_input_is_refused_and_not_counted(fake: FakeEngine) -> None:
    ae = AsyncEngine(fake)
    ae.start()

    async def go() -> None:
        with pytest.raises(ValueError, match="too long"):
            await ae.submit([([10] * 60, SamplingParams(max_tokens=10))])

    run(go())
    assert ae.num_in_flight == 0
    ae.stop()


def test_engine_death_fails_every_request_and_health() -> None:
    fake = FakeEngine(fail_at_step=3)
    ae = AsyncEngine(fake)
    ae.start()

    async def go() -> Any:
        group = await ae.submit([([10], SamplingParams(max_tokens=30))] * 2)
        return await collect(group)

    results = run(go())
    assert [r.finish_reason for r in results] == ["error", "error"]
    assert "boom" in (results[0].error or "")
    time.sleep(0.05)
    assert not ae.alive
    assert ae.num_in_flight == 0

    async def again() -> None:
        with pytest.raises(EngineDeadError):
            await ae.submit([([10], SamplingParams(max_tokens=3))])

    run(again())
    assert 'tokenmill:engine_loop_alive{model_name="fake"} 0' in ae.metrics.render()


def test_submit_racing_the_engines_end_is_refused_not_left_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """A submit that passed the alive check just before the thread finished: its command is refused (the
    thread closed its queue), so the await raises instead of waiting forever."""
    died: list[BaseException] = []
    ae = AsyncEngine(FakeEngine(fail_at_step=1), on_dead=died.append)
    ae.start()

    async def first() -> None:
        await collect(await ae.submit([([10], SamplingParams(max_tokens=5))]))

    run(first())
    assert ae._thread is not None
    ae._thread.join(5)
    assert len(died) == 1 and "boom" in str(died[0])  # on_dead ran once, on the engine thread's way out
    monkeypatch.setattr(AsyncEngine, "alive", property(lambda self: True))  # the check a racing submit saw

    async def racing() -> None:
        with pytest.raises(EngineDeadError):
            await ae.submit([([10], SamplingParams(max_tokens=3))])

    run(racing())
    assert ae.num_in_flight == 0


def test_stop_aborts_in_flight_and_refuses_new() -> None:
    fake = FakeEngine(step_s=0.01)
    ae = AsyncEngine(fake)
    ae.start()

    async def go() -> Any:
        group = await ae.submit([([10], SamplingParams(max_tokens=60))])
        await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, ae.stop)
        results = await collect(group)
        with pytest.raises(DrainingError):
            await ae.submit([([10], SamplingParams(max_tokens=3))])
        return results

    results = run(go())
    assert results[0].finish_reason == "abort"
    assert not ae.alive


# --- the app over ASGI (no sockets; streams are buffered by the transport) ---------------------------


@pytest.fixture
def client() -> Any:
    fake = FakeEngine()
    ae = AsyncEngine(fake, max_queue=16)
    ae.start()
    app = build_app(ae, "fake-model", api_key="sekrit", max_body_bytes=4096, max_tokens_past_context="refuse")
    transport = httpx.ASGITransport(app=app)
    c = httpx.AsyncClient(
        transport=transport, base_url="http://t", headers={"Authorization": "Bearer sekrit"}
    )
    yield c
    ae.stop()


def _events(body: str) -> list[str]:
    assert body.endswith("\n\n")
    frames = body.split("\n\n")[:-1]
    assert all(f.startswith("data: ") for f in frames), frames
    return [f[len("data: ") :] for f in frames]


def test_app_completion_roundtrip(client: httpx.AsyncClient) -> None:
    async def go() -> Any:
        r = await client.post(
            "/v1/completions",
            json={"model": "fake-model", "prompt": "hi", "max_tokens": 4, "n": 2, "logprobs": 1},
        )
        return r

    r = run(go())
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["text"] == "abcd"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 8,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "b", "c", "d"] and lp["text_offset"] == [0, 1, 2, 3]
    assert lp["top_logprobs"][0] == {"a": -0.5, "b": -1.5}


def test_app_streams_with_usage_and_done_once(client: httpx.AsyncClient) -> None:
    async def go(include_usage: bool) -> str:
        r = await client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
                "stream": True,
                "stream_options": {"include_usage": include_usage},
            },
        )
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return r.text

    for include_usage in (True, False):
        events = _events(run(go(include_usage)))
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        content = [c for c in chunks if c["choices"]]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in content) == "abc"
        assert content[-1]["choices"][0]["finish_reason"] == "length"
        usage = [c for c in chunks if c.get("usage")]
        if include_usage:
            assert len(usage) == 1 and usage[0]["choices"] == [] and usage[0] is chunks[-1]
            assert usage[0]["usage"]["completion_tokens"] == 3
        else:
            assert not usage and all("usage" not in c for c in chunks)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "lots"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": [5, 500]}, 400, "prompt"),
        ("/v1/completions", {}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "model": "nope"}, 404, "model"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 100}, 400, "messages"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            400,
            "top_logprobs",
        ),
    ],
)
def test_app_errors_are_openai_shaped(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    r = run(client.post(path, json=body))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param


def test_app_context_length_wording(client: httpx.AsyncClient) -> None:
    r = run(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 100}))
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert err["message"] == (
        "This model's maximum context length is 64 tokens. However, you requested 102 tokens "
        "(2 in the messages, 100 in the completion). Please reduce the length of the messages or completion."
    )


def test_app_auth_body_limit_and_open_routes(client: httpx.AsyncClient) -> None:
    async def go() -> None:
        r = await client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await client.get("/v1/models", headers={"Authorization": ""})
        assert r.status_code == 401
        r = await client.get("/not-a-route", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401  # unknown routes are behind the key too
        for path in ("/health", "/metrics"):
            r = await client.get(path, headers={"Authorization": ""})
            assert r.status_code == 200, path
        r = await client.get("/v1/models")
        card = r.json()["data"][0]
        assert card["id"] == "fake-model" and card["max_model_len"] == 64
        r = await client.post("/v1/completions", content=b'{"prompt": "' + b"x" * 5000 + b'"}')
        assert r.status_code == 413
        r = await client.post("/v1/completions", content=b"{not json")
        assert r.status_code == 400
        r = await client.get("/nope")
        assert r.status_code == 404 and "error" in r.json()
        r = await client.post("/tokenize", json={"prompt": "abc"})
        assert r.json()["tokens"] == [10, 11, 12] and r.json()["count"] == 3
        r = await client.post("/detokenize", json={"tokens": [10, 11]})
        assert r.json() == {"prompt": "ab"}
        r = await client.post("/detokenize", json={"tokens": [1000]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"

    run(go())


def test_app_failure_mid_stream_is_an_error_event_then_done() -> None:
    fake = FakeEngine(fail_at_step=3)
    ae = AsyncEngine(fake)
    ae.start()
    app = build_app(ae, "fake-model")
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")

    async def go() -> tuple[str, httpx.Response, httpx.Response]:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200
        after = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        health = await client.get("/health")
        return r.text, after, health

    text, after, health = run(go())
    events = _events(text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    error = json.loads(events[-2])["error"]
    assert "boom" in error["message"] and error["type"] == "server_error"
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
    assert after.status_code == 503 and after.json()["error"]["type"] == "server_error"
    assert health.status_code == 503


def test_a_model_alias_is_served_and_other_names_are_404() -> None:
    ae = AsyncEngine(FakeEngine())
    ae.start()
    try:
        app = build_app(ae, "fake-model", model_aliases=["fake-pulled-name"])
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")

        async def go() -> list[int]:
            out = []
            for name in ("fake-model", "fake-pulled-name", "other"):
                body = {"model": name, "prompt": "hi", "max_tokens": 2}
                out.append((await client.post("/v1/completions", json=body)).status_code)
            return out

        assert run(go()) == [200, 200, 404]
    finally:
        ae.stop()


def test_the_pulled_name_and_the_files_own_are_aliases(tmp_path, monkeypatch) -> None:
    from tokenmill.model import registry as models
    from tokenmill.server.launch import model_aliases

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    entry = models.CATALOGUE["all-minilm-l6-v2"]
    folder = models.model_path(entry.name)
    folder.mkdir(parents=True)
    ollama = [
        "all-minilm",
        "all-minilm:latest",
        "all-minilm:22m",
        "all-minilm:l6-v2",
    ]  # Ollama's names for it
    assert model_aliases(str(folder), "all-MiniLM-L6-v2", str(folder)) == [
        "all-MiniLM-L6-v2",
        "all-minilm-l6-v2",
        *ollama,
    ]
    assert model_aliases(str(folder), "all-MiniLM-L6-v2", "all-minilm-l6-v2") == [
        "all-MiniLM-L6-v2",
        "all-minilm-l6-v2",
        *ollama,
    ]
    assert model_aliases(str(tmp_path / "elsewhere.gguf"), "elsewhere", None) == ["elsewhere"]
