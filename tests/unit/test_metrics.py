"""The hand-written Prometheus exposition: format, cumulative buckets, labels, vLLM's names."""

from __future__ import annotations

import math
import re

import pytest

from tokenmill.server.metrics import (
    Counter,
    EngineSnapshot,
    Gauge,
    Histogram,
    Registry,
    RequestEvent,
    ServerMetrics,
    escape_label,
    format_value,
)

_SAMPLE = re.compile(
    r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? (\S+)$'
)


def parse(text: str) -> dict[str, float]:
    """``{'name{labels}': value}``; every line must be a comment or a well-formed sample."""
    samples = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram"), line
            assert name not in types, f"TYPE twice for {name}"
            types[name] = kind
            continue
        if line.startswith("# HELP ") or not line:
            continue
        m = _SAMPLE.match(line)
        assert m, f"malformed sample line: {line!r}"
        samples[m.group(1) + (m.group(2) or "")] = float(m.group(3).replace("+Inf", "inf"))
    return samples


def test_format_value() -> None:
    assert format_value(3.0) == "3"
    assert format_value(0.25) == "0.25"
    assert format_value(math.inf) == "+Inf"
    assert escape_label('a"b\\c\nd') == 'a\\"b\\\\c\\nd'


def test_counter_gauge_render_with_labels() -> None:
    reg = Registry()
    c = Counter("x_total", "help text", ("model_name",))
    g = Gauge("y", "a gauge", ())
    reg.add(c)
    reg.add(g)
    c.inc(("m",), 2)
    c.inc(("m",))
    g.set((), 0.5)
    text = reg.render()
    assert "# TYPE x_total counter" in text
    assert "# TYPE y gauge" in text
    samples = parse(text)
    assert samples['x_total{model_name="m"}'] == 3
    assert samples["y"] == 0.5
    with pytest.raises(ValueError):
        c.inc(("m",), -1)
    with pytest.raises(ValueError):
        c.inc(("m", "extra"))
    with pytest.raises(ValueError):
        reg.add(Counter("x_total", "again"))


def test_counter_set_total_never_shrinks() -> None:
    c = Counter("z_total", "h")
    c.set_total((), 5)
    c.set_total((), 3)
    assert c.get() == 5


def test_histogram_buckets_are_cumulative() -> None:
    h = Histogram("lat_seconds", "h", ("model_name",), buckets=(0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0):
        h.observe(("m",), v)
    samples = parse("\n".join(h.render()))
    assert samples['lat_seconds_bucket{model_name="m",le="0.1"}'] == 2  # le is inclusive
    assert samples['lat_seconds_bucket{model_name="m",le="1"}'] == 3
    assert samples['lat_seconds_bucket{model_name="m",le="+Inf"}'] == 4
    assert samples['lat_seconds_count{model_name="m"}'] == 4
    assert samples['lat_seconds_sum{model_name="m"}'] == pytest.approx(2.65)
    with pytest.raises(ValueError):
        Histogram("bad", "h", (), buckets=(1.0, 0.5))


VLLM_NAMES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
]
VLLM_HISTOGRAMS = [
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
]


def test_server_metrics_exports_vllm_names_before_any_request() -> None:
    text = ServerMetrics("tiny").render()
    samples = parse(text)
    for name in VLLM_NAMES:
        assert any(k.startswith(name) for k in samples), name
    for name in VLLM_HISTOGRAMS:
        assert f"# TYPE {name} histogram" in text
        assert samples[f'{name}_count{{model_name="tiny"}}'] == 0
        assert f'{name}_bucket{{model_name="tiny",le="+Inf"}}' in samples
    assert samples['vllm:request_success_total{model_name="tiny",finished_reason="stop"}'] == 0
    assert samples['tokenmill:engine_loop_alive{model_name="tiny"}'] == 1


def test_server_metrics_observe_and_engine_snapshot() -> None:
    m = ServerMetrics("tiny")
    m.observe_requests(
        [
            RequestEvent(queue_time_s=0.01),
            RequestEvent(num_prompt_tokens=7, num_new_tokens=1, ttft_s=0.2),
            RequestEvent(num_new_tokens=2, itl_s=0.05),
            RequestEvent(num_new_tokens=1, itl_s=0.05, finish_reason="length", e2e_s=0.4),
        ]
    )
    m.update_engine(
        EngineSnapshot(
            num_running=3,
            num_waiting=2,
            kv_cache_usage=0.25,
            num_preemptions=4,
            occupancy=0.5,
            idle_rows_by_reason={"queue_empty": 9, "kv_pool_full": 1},
        ),
        num_in_flight=5,
        alive=True,
    )
    m.count_rejection()
    s = parse(m.render())
    lbl = '{model_name="tiny"}'
    assert s[f"vllm:prompt_tokens_total{lbl}"] == 7
    assert s[f"vllm:generation_tokens_total{lbl}"] == 4
    assert s[f"vllm:time_to_first_token_seconds_count{lbl}"] == 1
    assert s[f"vllm:inter_token_latency_seconds_count{lbl}"] == 2
    assert s[f"vllm:e2e_request_latency_seconds_count{lbl}"] == 1
    assert s[f"vllm:request_queue_time_seconds_count{lbl}"] == 1
    assert s['vllm:request_success_total{model_name="tiny",finished_reason="length"}'] == 1
    assert s[f"vllm:num_requests_running{lbl}"] == 3
    assert s[f"vllm:num_requests_waiting{lbl}"] == 2
    assert s[f"vllm:kv_cache_usage_perc{lbl}"] == 0.25
    assert s[f"vllm:num_preemptions_total{lbl}"] == 4
    assert s[f"tokenmill:batch_occupancy{lbl}"] == 0.5
    assert s['tokenmill:idle_rows_total{model_name="tiny",reason="queue_empty"}'] == 9
    assert s[f"tokenmill:num_requests_in_flight{lbl}"] == 5
    assert s[f"tokenmill:queue_rejections_total{lbl}"] == 1


def test_build_info_names_the_kernels_in_use() -> None:
    from tokenmill import system_info

    info = system_info.collect()
    m = ServerMetrics("tiny")
    m.set_build_info(info)
    samples = parse(m.render())
    (key,) = [k for k in samples if k.startswith("tokenmill:build_info")]
    assert samples[key] == 1
    assert f'kernel_variant="{info["kernel_variant"]}"' in key and f'torch="{info["torch"]}"' in key
    off = [name for name, state in info["fast_paths"].items() if state.startswith("off")]
    assert f'fast_paths_off="{",".join(off)}"' in key
