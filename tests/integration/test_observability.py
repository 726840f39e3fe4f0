"""Observability on the embedded model: per-request timings, OTLP spans, record and replay.

The app runs in-process (httpx's ASGI transport) over a real Engine, with the traffic recorder and the tracer
attached as ``tokenmill serve --record --otlp-traces-endpoint`` attaches them; the spans go over real OTLP/HTTP
to a receiver this module starts, and are decoded with opentelemetry-proto.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tokenmill.bench.replay import ReplayConfig, replay_live, replay_unit
from tokenmill.measure.traffic import read_traffic
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.app import build_app
from tokenmill.server.async_engine import AsyncEngine, collect
from tokenmill.server.recorder import TrafficRecorder
from tokenmill.server.tracing import RequestTracer

# --- an OTLP/HTTP receiver -------------------------------------------------------------------------------


class Receiver:
    """Collects every span POSTed to ``/v1/traces`` (ExportTraceServiceRequest, protobuf)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        spans: list[Any] = []
        self.spans = spans

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource_spans in request.resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        spans.extend(scope_spans.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


class Served:
    def __init__(self, engine: Any, receiver: Receiver, record_path: Path) -> None:
        self.engine = engine
        self.tracer = RequestTracer(receiver.url, "smollm2")
        self.recorder = TrafficRecorder(record_path, engine, "smollm2")
        self.async_engine = AsyncEngine(engine, observers=[self.tracer, self.recorder])
        self.app = build_app(self.async_engine, "smollm2", enable_per_request_metrics=True)
        self.record_path = record_path

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://test", timeout=120
        )


@pytest.fixture(scope="module")
def served(
    make_engine: Any, receiver: Receiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    s = Served(make_engine(num_kv_blocks=256), receiver, tmp_path_factory.mktemp("rec") / "traffic.jsonl")
    s.async_engine.start()
    yield s
    s.async_engine.stop()


def _adds_up(m: dict[str, Any]) -> None:
    """queue + prefill + decode is arrival to last token, which is the finish for a stop or a length."""
    total = m["queue_time_ms"] + m["prefill_time_ms"] + m["decode_time_ms"]
    assert abs(total - m["e2e_time_ms"]) <= 1.0
    assert abs(m["queue_time_ms"] + m["prefill_time_ms"] - m["time_to_first_token_ms"]) <= 1.0
    assert min(m["queue_time_ms"], m["prefill_time_ms"], m["decode_time_ms"]) >= 0


# --- per-request timings -------------------------------------------------------------------------------


def test_per_request_metrics_in_the_body_add_up(served: Served) -> None:
    async def go() -> dict[str, Any]:
        async with served.client() as c:
            r = await c.post("/v1/chat/completions", json={
                "model": "smollm2", "messages": [{"role": "user", "content": "Name three colours."}],
                "max_tokens": 12, "temperature": 0,
            })  # fmt: skip
            assert r.status_code == 200, r.text
            return dict(r.json())

    body = asyncio.run(go())
    m, usage = body["metrics"], body["usage"]
    _adds_up(m)
    assert m["num_output_tokens"] == usage["completion_tokens"]
    assert m["num_prompt_tokens"] == usage["prompt_tokens"]
    assert m["num_cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert m["num_preemptions"] == 0 and m["num_recomputed_tokens"] == 0
    n = m["num_output_tokens"]
    assert m["tokens_per_second"] == pytest.approx((n - 1) / (m["decode_time_ms"] / 1000), rel=1e-3)
    assert m["mean_itl_ms"] == pytest.approx(m["decode_time_ms"] / (n - 1), rel=1e-3)


def test_per_request_metrics_in_the_final_stream_chunk(served: Served) -> None:
    async def go(include_usage: bool) -> list[dict[str, Any]]:
        async with served.client() as c:
            body = {"model": "smollm2", "prompt": "The sky is", "max_tokens": 6, "temperature": 0, "n": 2,
                    "seed": 1, "stream": True}  # fmt: skip
            if include_usage:
                body["stream_options"] = {"include_usage": True}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200
            return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]

    for include_usage in (True, False):
        chunks = asyncio.run(go(include_usage))
        with_metrics = [c for c in chunks if "metrics" in c]
        assert with_metrics == [chunks[-1]] and chunks[-1]["choices"] == []  # the last chunk, and only it
        assert ("usage" in chunks[-1]) == include_usage
        per_choice = chunks[-1]["metrics"]
        assert [m["index"] for m in per_choice] == [0, 1]  # n=2: one object per choice
        for m in per_choice:
            _adds_up(m)
            assert m["num_output_tokens"] == 6


def test_timings_agree_with_the_engine_stats_under_preemption(make_engine: Any) -> None:
    """A pool too small for everyone: the preemptions and recomputed tokens each request reports sum to the
    engine's own counts, and every request's splits add up to its end-to-end time."""
    engine = make_engine(num_kv_blocks=12, max_num_seqs=8)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outputs = engine.generate([f"Story number {i} begins" for i in range(8)], params)
    ms = [o.metrics for o in outputs]
    assert engine.stats.num_preemptions > 0
    assert sum(m.num_preemptions for m in ms) == engine.stats.num_preemptions
    assert sum(m.num_recomputed_tokens for m in ms) == engine.stats.num_recomputed_tokens > 0
    for m in ms:
        assert m.num_output_tokens == 40
        assert abs(m.queue_time_s + m.prefill_time_s + m.decode_time_s - m.e2e_time_s) < 1e-3
        assert m.first_scheduled_time_s >= m.arrival_time_s


# --- tracing ------------------------------------------------------------------------------------------


def test_spans_reach_the_otlp_receiver_with_vllm_attributes_and_parent(
    served: Served, receiver: Receiver
) -> None:
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"

    async def go() -> dict[str, Any]:
        async with served.client() as c:
            r = await c.post(
                "/v1/completions",
                json={
                    "model": "smollm2",
                    "prompt": "Hello",
                    "max_tokens": 5,
                    "temperature": 0.5,
                    "top_p": 0.9,
                },
                headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
            )
            assert r.status_code == 200
            return dict(r.json())

    body = asyncio.run(go())
    served.tracer.provider.force_flush()
    spans = [s for s in receiver.spans if s.trace_id.hex() == trace_id]
    assert len(spans) == 1
    span = spans[0]
    assert span.name == "llm_request" and span.parent_span_id.hex() == parent_id
    attrs = {a.key: a.value for a in span.attributes}

    def value(key: str) -> Any:
        v = attrs[key]
        return getattr(v, v.WhichOneof("value"))

    assert value("gen_ai.request.max_tokens") == 5
    assert value("gen_ai.request.temperature") == pytest.approx(0.5)
    assert value("gen_ai.request.top_p") == pytest.approx(0.9)
    assert value("gen_ai.usage.prompt_tokens") == body["usage"]["prompt_tokens"]
    assert value("gen_ai.usage.completion_tokens") == body["usage"]["completion_tokens"]
    assert value("gen_ai.response.model") == "smollm2"
    m = body["metrics"]
    assert value("gen_ai.latency.time_in_queue") * 1000 == pytest.approx(m["queue_time_ms"], abs=1e-2)
    assert value("gen_ai.latency.time_to_first_token") * 1000 == pytest.approx(
        m["time_to_first_token_ms"], abs=1e-2
    )
    assert value("gen_ai.latency.e2e") * 1000 == pytest.approx(m["e2e_time_ms"], abs=1e-2)
    assert (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6 == pytest.approx(
        m["e2e_time_ms"], abs=0.5
    )


def test_a_request_without_traceparent_starts_its_own_trace(served: Served, receiver: Receiver) -> None:
    before = len(receiver.spans)

    async def go() -> None:
        async with served.client() as c:
            r = await c.post("/v1/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200

    asyncio.run(go())
    served.tracer.provider.force_flush()
    new = receiver.spans[before:]
    assert len(new) == 1 and new[0].parent_span_id == b"" and len(new[0].trace_id) == 16


# --- record and replay --------------------------------------------------------------------------------


def test_replay_of_a_recorded_seed_run_reproduces_the_seed(make_engine: Any, tmp_path: Path) -> None:
    """The seed's workload (eight 5-token prompts, seven wanting 4 tokens and one 32) served and recorded, then
    replayed on the unit clock: the recorded configuration gives the seed's 32 iterations, 60 token-slots and
    occupancy 0.234, as the served run itself did; a pool of four blocks with worst-case reservations gives the
    seed's pool-of-four table (40 iterations, 0.188), incremental allocation on it 36 (0.208)."""
    engine = make_engine(num_kv_blocks=256, max_num_seqs=8, block_size=16)
    path = tmp_path / "seed.jsonl"
    recorder = TrafficRecorder(path, engine, "smollm2")
    ae = AsyncEngine(engine, observers=[recorder])
    ae.start()
    prompts = [[1000 + 10 * i + k for k in range(5)] for i in range(8)]
    limits = [4] * 7 + [32]

    async def go() -> None:
        group = await ae.submit([(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
                                 for p, m in zip(prompts, limits, strict=True)])  # fmt: skip
        await collect(group)

    iterations_before = engine.stats.num_iterations
    asyncio.run(go())
    ae.stop()
    served_iterations = engine.stats.num_iterations - iterations_before
    assert served_iterations == 32  # the served run was the seed's

    traffic = read_traffic(path)
    assert [r.num_output_tokens for r in traffic.requests] == limits  # in the order they arrived
    assert all(
        r.num_prompt_tokens == 5 and r.prefix_keys == [] and r.arrival_iteration == 0
        for r in traffic.requests
    )
    base = ReplayConfig.of(traffic)
    assert (base.num_kv_blocks, base.max_num_seqs, base.block_size) == (256, 8, 16)
    recorded = replay_unit(traffic, base)
    assert recorded.timing.num_iterations == served_iterations
    assert recorded.timing.token_slots == 60
    assert f"{recorded.timing.occupancy:.3f}" == "0.234"
    four = replay_unit(traffic, base.with_changes({"num_kv_blocks": 4, "reserve": "worst_case"}), "pool of 4")
    assert (four.timing.num_iterations, f"{four.timing.occupancy:.3f}") == (40, "0.188")
    assert four.timing.idle_rows_by_reason.get("kv_reserved", 0) > 0
    incremental = replay_unit(traffic, base.with_changes({"num_kv_blocks": 4}))
    assert (incremental.timing.num_iterations, f"{incremental.timing.occupancy:.3f}") == (36, "0.208")


def test_recording_keeps_prefix_sharing_not_text(served: Served) -> None:
    """Two chats with one long system message share their first blocks; the recording's keys say so, and the
    replay's prefix cache finds them as the server's did. No text is in the file."""
    system = "You are a careful assistant who answers in one short sentence. " * 6

    async def go() -> list[dict[str, Any]]:
        out = []
        async with served.client() as c:
            for question in ("What is two plus two?", "Name a colour."):
                r = await c.post("/v1/chat/completions", json={
                    "model": "smollm2", "max_tokens": 4, "temperature": 0,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                })  # fmt: skip
                out.append(r.json())
        return out

    bodies = asyncio.run(go())
    text = served.record_path.read_text()
    assert "careful assistant" not in text and "colour" not in text
    traffic = read_traffic(served.record_path)
    first, second = [r for r in traffic.requests if r.request_id.startswith("chatcmpl")][-2:]
    shared = 0
    while shared < min(len(first.prefix_keys), len(second.prefix_keys)) and (
        first.prefix_keys[shared] == second.prefix_keys[shared]
    ):
        shared += 1
    cached = bodies[1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and shared * traffic.block_size >= cached
    assert first.prefix_keys[shared:] != second.prefix_keys[shared:] or len(first.prefix_keys) == shared
    result = replay_unit(traffic, ReplayConfig.of(traffic))
    assert result.num_prefix_hit_tokens >= cached


def test_live_replay_against_the_server(served: Served) -> None:
    traffic = read_traffic(served.record_path)
    assert traffic.requests
    summary = asyncio.run(replay_live(traffic, "http://test", speed=50.0,
                                      transport=httpx.ASGITransport(app=served.app)))  # fmt: skip
    replayable = [r for r in traffic.requests if r.num_output_tokens > 0]
    assert summary["completed"] == len(replayable) and summary["failed"] == 0
    assert summary["total_output_tokens"] == sum(r.num_output_tokens for r in replayable)
    assert summary["ttft_ms"]["p99"] > 0


# --- the flags, on a real `tokenmill serve`; `bench serve` and `chat --stats` ---------------------------


def test_serve_flags_record_and_report_per_request_metrics(tmp_path: Path) -> None:
    """``tokenmill serve --enable-per-request-metrics --record FILE``: the openai SDK sees ``metrics`` on a chat
    completion, ``bench serve`` prints the server's own timings, and after SIGTERM the file holds every request."""
    import openai
    from serverproc import ServerProcess

    from tokenmill.bench.serve_bench import BenchConfig, format_report, run_benchmark, summarize

    path = tmp_path / "traffic.jsonl"
    server = ServerProcess("--enable-per-request-metrics", "--record", str(path)).start()
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
        model = client.models.list().data[0].id
        completion = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=5, temperature=0
        )
        metrics = (completion.model_extra or {})["metrics"]
        _adds_up(metrics)
        assert metrics["num_output_tokens"] == completion.usage.completion_tokens
        cfg = BenchConfig(base_url=server.base_url, num_prompts=4, input_len=16, output_len=4)
        results, duration, _ = asyncio.run(run_benchmark(cfg))
        summary = summarize(results, duration, cfg)
        assert summary["server"]["num_reported"] == 4
        assert summary["server"]["e2e_time_ms"]["mean"] > 0
        assert "Server's own timings (4 requests)" in format_report(summary)
    finally:
        assert server.stop() == 0
    traffic = read_traffic(path)
    assert len(traffic.requests) == 5
    assert sorted(r.num_output_tokens for r in traffic.requests) == [4, 4, 4, 4, 5]
    assert [r.arrival_index for r in traffic.requests] == [0, 1, 2, 3, 4]
    assert all(r.prompt is None for r in traffic.requests)


def test_chat_stats_show_the_engine_timings(make_engine: Any) -> None:
    import io
    import re

    from tokenmill.cli.chat_session import ChatSession

    out = io.StringIO()
    session = ChatSession(make_engine(), SamplingParams(max_tokens=6, temperature=0.0), stats=True, out=out)
    session._answer("Hello")
    line = out.getvalue().strip().splitlines()[-1]
    pattern = (r"\[6 tokens, first token (\d+) ms \(queue (\d+) ms, prefill (\d+) ms\), decode (\d+) ms at "
               r"[\d.]+ tokens/s; prompt (\d+) tokens, (\d+) cached; 0 preemptions, 0 tokens recomputed\]")  # fmt: skip
    match = re.fullmatch(pattern, line)
    assert match, line
    ttft, queue, prefill = (int(match.group(i)) for i in (1, 2, 3))
    assert abs(ttft - queue - prefill) <= 1  # rounded to whole milliseconds each


# --- each step's fraction of the machine's limit -------------------------------------------------------


def test_step_roofline_fraction_on_metrics(make_engine: Any) -> None:
    """With the machine's limits given, every step is observed in ``tokenmill:step_roofline_fraction`` under its
    kind, as many as the engine's own roofline counts say, and the fractions are the bound over the wall time."""
    from prometheus_client.parser import text_string_to_metric_families

    engine = make_engine(hardware_limits="400,30")
    ae = AsyncEngine(engine)
    ae.start()

    async def go() -> None:
        await collect(
            await ae.submit([([1000 + k for k in range(40)], SamplingParams(max_tokens=12, ignore_eos=True))])
        )

    asyncio.run(go())
    ae.stop()
    counts = {
        s.labels["kind"]: s.value
        for family in text_string_to_metric_families(ae.metrics.render())
        if family.name == "tokenmill:step_roofline_fraction"
        for s in family.samples
        if s.name.endswith("_count")
    }
    assert counts == {k: float(n) for k, n in engine.stats.num_roofline_steps.items()}
    assert counts["decode"] == 11 and counts["prefill"] == 1
    assert 0 < engine.stats.roofline_fraction_by_kind["decode"] < 1.5


@pytest.mark.slow
def test_decode_roofline_agrees_with_the_suite_case_c(make_engine: Any) -> None:
    """The suite's case (c) (the chat prompt, 128 greedy tokens, one stream) measured as the suite measures it
    (its lower bound over the run's wall time, ``cost_model.workload_bound``) and the engine's per-step decode
    fraction of the same run, against the same measured limits: within 20% of each other."""
    import sys
    import time

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks import workloads

    from tokenmill.measure.cost_model import ModelShape, workload_bound

    engine = make_engine(hardware_limits="measure")
    limits = engine.roofline.limits
    shape = ModelShape.from_config(engine.loaded.config)
    prompt = engine.tokenizer.encode_chat(workloads.CHAT_MESSAGES)
    case = workloads.build("c", engine.tokenizer.vocab_size, prompt)
    params = SamplingParams(max_tokens=case.max_tokens[0], temperature=0.0, ignore_eos=True)
    engine.generate([list(case.prompts[0])], SamplingParams(max_tokens=2, ignore_eos=True))  # warm up
    before_s, before_n = dict(engine.stats.roofline_step_s), dict(engine.stats.roofline_bound_s)
    t0 = time.perf_counter()
    engine.generate([list(case.prompts[0])], params)
    elapsed_s = time.perf_counter() - t0
    bound = workload_bound(shape, case.prompt_lens, case.max_tokens, limits.peak_flops, limits.peak_read_bw,
                           engine.roofline.weight_bytes, engine.roofline.kv_bytes)  # fmt: skip
    suite_fraction = bound.time_s / elapsed_s
    decode = (engine.stats.roofline_bound_s["decode"] - before_n.get("decode", 0.0)) / (
        engine.stats.roofline_step_s["decode"] - before_s.get("decode", 0.0)
    )
    print(
        f"\ncase (c): suite fraction {suite_fraction:.3f}, engine decode steps {decode:.3f}; {limits.describe()}"
    )
    assert abs(decode - suite_fraction) <= 0.2 * suite_fraction


def test_request_histograms_are_the_per_request_metrics(make_engine: Any) -> None:
    """vLLM's per-request histograms (prefill, decode, inference time; prompt and generation tokens) are observed
    from the same RequestMetrics the response carries: their sums equal the requests' own numbers."""
    from prometheus_client.parser import text_string_to_metric_families

    ae = AsyncEngine(make_engine())
    ae.start()

    async def go() -> list[Any]:
        params = SamplingParams(max_tokens=7, ignore_eos=True)
        group = await ae.submit([([1000 + k for k in range(9 + i)], params) for i in range(3)])
        return await collect(group)

    results = asyncio.run(go())
    ae.stop()
    sums = {
        s.name: s.value
        for family in text_string_to_metric_families(ae.metrics.render())
        for s in family.samples
        if s.name.endswith("_sum")
    }
    ms = [r.metrics for r in results]
    assert sums["vllm:request_prompt_tokens_sum"] == 9 + 10 + 11
    assert sums["vllm:request_generation_tokens_sum"] == 21
    assert sums["vllm:request_prefill_time_seconds_sum"] == pytest.approx(sum(m.prefill_time_s for m in ms))
    assert sums["vllm:request_decode_time_seconds_sum"] == pytest.approx(sum(m.decode_time_s for m in ms))
    assert sums["vllm:request_inference_time_seconds_sum"] == pytest.approx(
        sum(m.prefill_time_s + m.decode_time_s for m in ms)
    )
