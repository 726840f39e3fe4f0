"""The serving benchmark's pure parts, and its client against a scripted SSE server (httpx.MockTransport)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random

import httpx
import pytest

from tokenmill.bench.serve_bench import (
    BenchConfig,
    RequestResult,
    add_bench_serve_arguments,
    config_from_args,
    format_report,
    percentile,
    poisson_arrivals,
    run_benchmark,
    summarize,
)


def test_poisson_arrivals() -> None:
    assert poisson_arrivals(3, math.inf, random.Random(0)) == [0.0, 0.0, 0.0]
    times = poisson_arrivals(4000, 10.0, random.Random(1))
    assert times[0] == 0.0 and times == sorted(times)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.05)
    assert poisson_arrivals(5, 2.0, random.Random(7)) == poisson_arrivals(5, 2.0, random.Random(7))


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([], 50) == 0.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)


def _result(ttft: float, e2el: float, tokens: int, ok: bool = True) -> RequestResult:
    gaps = [(e2el - ttft) / (tokens - 1)] * (tokens - 1) if tokens > 1 else []
    return RequestResult(
        success=ok, prompt_len=10, output_tokens=tokens, ttft_s=ttft, e2el_s=e2el, itl_s=gaps
    )


def test_summarize_and_goodput() -> None:
    cfg = BenchConfig(
        base_url="http://x", num_prompts=4, input_len=10, output_len=5, slo_ttft_ms=150, slo_tpot_ms=60
    )
    results = [
        _result(0.1, 0.3, 5),  # tpot 50 ms: good
        _result(0.2, 0.4, 5),  # ttft 200 ms: misses
        _result(0.1, 0.9, 5),  # tpot 200 ms: misses
        RequestResult(success=False, prompt_len=10, error="HTTP 429: full"),
    ]
    s = summarize(results, duration_s=2.0, cfg=cfg)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 15
    assert s["request_throughput_rps"] == 1.5 and s["output_throughput_tps"] == 7.5
    assert s["total_token_throughput_tps"] == 22.5
    assert s["num_good"] == 1 and s["goodput_rps"] == 0.5
    assert s["ttft_ms"]["mean"] == pytest.approx(400 / 3)
    assert s["ttft_ms"]["median"] == pytest.approx(100)
    assert s["tpot_ms"]["median"] == pytest.approx(50)
    assert s["e2el_ms"]["p99"] == pytest.approx(890.0)
    assert s["errors"] == {"HTTP 429: full": 1}
    text = format_report(s)
    for needle in (
        "Mean TTFT (ms)",
        "Median TPOT (ms)",
        "P99 ITL (ms)",
        "Mean E2EL (ms)",
        "Request goodput",
        "429",
    ):
        assert needle in text
    no_slo = summarize(results, 2.0, BenchConfig(base_url="http://x"))
    assert no_slo["goodput_rps"] is None and "goodput" not in format_report(no_slo)
    json.dumps(no_slo)  # plain JSON (an infinite rate is written as "inf")


def test_cli_arguments() -> None:
    parser = argparse.ArgumentParser()
    add_bench_serve_arguments(parser)
    args = parser.parse_args(
        ["--port", "9000", "--request-rate", "4", "--max-concurrency", "8", "--num-prompts", "20",
         "--input-len", "32", "--output-len", "16", "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--json"]
    )  # fmt: skip
    cfg = config_from_args(args)
    assert cfg.base_url == "http://127.0.0.1:9000" and cfg.request_rate == 4 and cfg.max_concurrency == 8
    assert (cfg.num_prompts, cfg.input_len, cfg.output_len) == (20, 32, 16)
    assert (cfg.slo_ttft_ms, cfg.slo_tpot_ms) == (500, 50)
    assert args.json == "-"
    with pytest.raises(ValueError):
        BenchConfig(base_url="http://x", request_rate=0)


class ScriptedServer:
    """/v1/models, /tokenize and a streaming /v1/completions that emits one chunk per token."""

    def __init__(self, fail_every: int = 0) -> None:
        self.bodies: list[dict[str, object]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.fail_every = fail_every

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "scripted"}]})
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": list(range(100, 140)), "count": 40})
        body = json.loads(request.content)
        self.bodies.append(body)
        if self.fail_every and len(self.bodies) % self.fail_every == 0:
            return httpx.Response(429, json={"error": {"message": "full"}})
        return httpx.Response(200, stream=_Stream(self, int(body["max_tokens"])))  # type: ignore[arg-type]


class _Stream(httpx.AsyncByteStream):
    def __init__(self, server: ScriptedServer, num_tokens: int) -> None:
        self.server = server
        self.num_tokens = num_tokens

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        self.server.in_flight += 1
        self.server.max_in_flight = max(self.server.max_in_flight, self.server.in_flight)
        for i in range(self.num_tokens):
            await asyncio.sleep(0.002)
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f't{i}'}]})}\n\n".encode()
        usage = {
            "prompt_tokens": 1,
            "completion_tokens": self.num_tokens,
            "total_tokens": 1 + self.num_tokens,
        }
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
        self.server.in_flight -= 1  # before [DONE]: the client stops reading there
        yield b"data: [DONE]\n\n"


def test_client_against_scripted_server() -> None:
    server = ScriptedServer()
    cfg = BenchConfig(base_url="http://bench", num_prompts=12, input_len=16, output_len=5, max_concurrency=3)
    results, duration_s, model = asyncio.run(run_benchmark(cfg, transport=httpx.MockTransport(server)))
    assert model == "scripted"
    assert all(r.success for r in results)
    assert all(r.output_tokens == 5 and len(r.itl_s) == 4 for r in results)
    assert all(0 < r.ttft_s <= r.e2el_s for r in results)
    assert server.max_in_flight <= 3
    assert len(server.bodies) == 12
    body = server.bodies[0]
    assert body["stream"] is True and body["ignore_eos"] is True and body["max_tokens"] == 5
    prompt = body["prompt"]
    assert isinstance(prompt, list) and len(prompt) == 16 and all(100 <= t < 140 for t in prompt)
    s = summarize(results, duration_s, cfg)
    assert s["completed"] == 12 and s["total_output_tokens"] == 60


def test_client_counts_failures() -> None:
    server = ScriptedServer(fail_every=3)
    cfg = BenchConfig(base_url="http://bench", num_prompts=6, input_len=4, output_len=2, request_rate=1000.0)
    results, _, _ = asyncio.run(run_benchmark(cfg, transport=httpx.MockTransport(server)))
    failed = [r for r in results if not r.success]
    assert len(failed) == 2 and all("429" in (r.error or "") for r in failed)


def test_random_range_ratio_and_prefix_len_shape_the_prompts() -> None:
    """vLLM's random-dataset knobs: lengths uniform in [n(1-r), n(1+r)], and a prefix every prompt shares."""
    import asyncio
    import random

    import httpx

    from tokenmill.bench.serve_bench import BenchConfig, make_prompts

    cfg = BenchConfig(base_url="http://x", num_prompts=200, input_len=100, output_len=40, random_range_ratio=0.5,
                      random_prefix_len=32)  # fmt: skip
    lengths = cfg.lengths()
    assert lengths == cfg.lengths()  # reproducible
    assert all(50 <= n <= 150 and 20 <= m <= 60 for n, m in lengths)
    assert len({n for n, _ in lengths}) > 20 and len({m for _, m in lengths}) > 10

    async def go() -> list[list[int]]:
        transport = httpx.MockTransport(lambda request: httpx.Response(404))  # no /tokenize: fallback ids
        async with httpx.AsyncClient(base_url="http://x", transport=transport) as client:
            return await make_prompts(client, cfg, "m", random.Random(0))

    prompts = asyncio.run(go())
    assert [len(p) for p in prompts] == [32 + n for n, _ in lengths]
    assert all(p[:32] == prompts[0][:32] for p in prompts) and len({tuple(p[32:40]) for p in prompts}) > 190
    with pytest.raises(ValueError, match="random_range_ratio"):
        BenchConfig(base_url="http://x", random_range_ratio=1.0)
