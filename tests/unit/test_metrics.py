"""The server's metrics: vLLM's names and labels, what the engine and the requests move, parsed back with
prometheus_client's own text parser (the independent reference for the exposition format)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tokenmill.server.metrics import EngineSnapshot, RequestEvent, ServerMetrics
from tokenmill.stats import EngineStats


def parse(text: str) -> dict[str, float]:
    """``{'name{k="v",...}': value}`` with the labels sorted by name; the parser rejects malformed text."""
    samples = {}
    for family in text_string_to_metric_families(text):
        assert family.type in ("counter", "gauge", "histogram"), family
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            assert key not in samples, f"sample twice: {key}"
            samples[key] = sample.value
    return samples


def test_counters_mirror_engine_totals_and_never_shrink() -> None:
    m = ServerMetrics("tiny")
    m.update_engine(EngineSnapshot(totals=EngineStats(num_preemptions=5)), num_in_flight=0, alive=True)
    m.update_engine(EngineSnapshot(totals=EngineStats(num_preemptions=3)), num_in_flight=0, alive=True)
    assert parse(m.render())['vllm:num_preemptions_total{model_name="tiny"}'] == 5
    m.update_engine(
        EngineSnapshot(totals=EngineStats(num_preemptions=7)), num_in_flight=0, alive=True, num_failed_steps=2
    )
    samples = parse(m.render())
    assert samples['vllm:num_preemptions_total{model_name="tiny"}'] == 7
    assert samples['tokenmill:failed_steps_total{model_name="tiny"}'] == 2


def test_histogram_buckets_are_cumulative() -> None:
    m = ServerMetrics("tiny")
    m.observe_requests([RequestEvent(ttft_s=v) for v in (0.05, 0.1, 0.5, 2.0)])
    s = parse(m.render())
    name = "vllm:time_to_first_token_seconds"
    assert s[f'{name}_bucket{{le="0.1",model_name="tiny"}}'] == 2  # le is inclusive
    assert s[f'{name}_bucket{{le="1.0",model_name="tiny"}}'] == 3
    assert s[f'{name}_bucket{{le="+Inf",model_name="tiny"}}'] == 4
    assert s[f'{name}_count{{model_name="tiny"}}'] == 4
    assert abs(s[f'{name}_sum{{model_name="tiny"}}'] - 2.65) < 1e-9


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
        assert f'{name}_bucket{{le="+Inf",model_name="tiny"}}' in samples
    assert samples['vllm:request_success_total{finished_reason="stop",model_name="tiny"}'] == 0
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
            totals=EngineStats(
                num_preemptions=4,
                num_token_slots=10,
                num_rows_possible=20,  # occupancy 0.5
                idle_rows_by_reason={"queue_empty": 9, "kv_pool_full": 1},
            ),
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
    assert s['vllm:request_success_total{finished_reason="length",model_name="tiny"}'] == 1
    assert s[f"vllm:num_requests_running{lbl}"] == 3
    assert s[f"vllm:num_requests_waiting{lbl}"] == 2
    assert s[f"vllm:kv_cache_usage_perc{lbl}"] == 0.25
    assert s[f"vllm:num_preemptions_total{lbl}"] == 4
    assert s[f"tokenmill:batch_occupancy{lbl}"] == 0.5
    assert s['tokenmill:idle_rows_total{model_name="tiny",reason="queue_empty"}'] == 9
    assert s['tokenmill:idle_rows_total{model_name="tiny",reason="kv_pool_full"}'] == 1
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
