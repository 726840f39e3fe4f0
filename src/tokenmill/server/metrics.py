"""Prometheus text exposition (format 0.0.4), hand-written: counters, gauges and histograms with labels.

The engine thread observes; the HTTP thread renders. One lock guards both, so a scrape never sees a
histogram whose ``_count`` disagrees with its buckets. Names follow vLLM's (``vllm:...``) so existing
dashboards work; tokenmill's own series (occupancy, idle rows by reason) are ``tokenmill:...``.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

LabelValues = tuple[str, ...]

# Bucket bounds in seconds, close to vLLM's.
TTFT_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS_S = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS_S = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)


def format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def format_labels(names: Sequence[str], values: Sequence[str], extra: Mapping[str, str] | None = None) -> str:
    pairs = list(zip(names, values))
    if extra:
        pairs.extend(extra.items())
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{escape_label(v)}"' for k, v in pairs) + "}"


@dataclass
class _Metric:
    name: str
    help: str
    label_names: tuple[str, ...] = ()

    kind = "untyped"

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def _key(self, labels: Sequence[str]) -> LabelValues:
        if len(labels) != len(self.label_names):
            raise ValueError(f"{self.name}: expected labels {self.label_names}, got {tuple(labels)}")
        return tuple(str(v) for v in labels)


@dataclass
class _ScalarMetric(_Metric):
    """One number per label set (counters and gauges)."""

    values: dict[LabelValues, float] = field(default_factory=dict)

    def get(self, labels: Sequence[str] = ()) -> float:
        return self.values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        lines = self.header()
        for key, value in self.values.items():
            lines.append(f"{self.name}{format_labels(self.label_names, key)} {format_value(value)}")
        return lines


@dataclass
class Counter(_ScalarMetric):
    """A monotonically increasing total. Name it ``..._total``."""

    kind = "counter"

    def inc(self, labels: Sequence[str] = (), amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter cannot go down (inc by {amount})")
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def set_total(self, labels: Sequence[str], total: float) -> None:
        """Mirror a total kept elsewhere (the engine's stats); it must not shrink."""
        key = self._key(labels)
        self.values[key] = max(self.values.get(key, 0.0), float(total))


@dataclass
class Gauge(_ScalarMetric):
    kind = "gauge"

    def set(self, labels: Sequence[str], value: float) -> None:
        self.values[self._key(labels)] = float(value)


@dataclass
class _HistogramSeries:
    bucket_counts: list[int]  # per bucket, not cumulative; the last is +Inf
    sum: float = 0.0
    count: int = 0


@dataclass
class Histogram(_Metric):
    buckets: tuple[float, ...] = ()
    series: dict[LabelValues, _HistogramSeries] = field(default_factory=dict)
    kind = "histogram"

    def __post_init__(self) -> None:
        if list(self.buckets) != sorted(set(self.buckets)) or not self.buckets:
            raise ValueError(f"{self.name}: buckets must be non-empty, increasing and distinct")

    def _series(self, labels: Sequence[str]) -> _HistogramSeries:
        key = self._key(labels)
        s = self.series.get(key)
        if s is None:
            s = self.series[key] = _HistogramSeries([0] * (len(self.buckets) + 1))
        return s

    def observe(self, labels: Sequence[str], value: float) -> None:
        s = self._series(labels)
        s.bucket_counts[bisect.bisect_left(self.buckets, value)] += 1  # le: value <= bound
        s.sum += value
        s.count += 1

    def touch(self, labels: Sequence[str]) -> None:
        """Create the series with zero observations, so it is scraped before the first one."""
        self._series(labels)

    def count(self, labels: Sequence[str] = ()) -> int:
        s = self.series.get(self._key(labels))
        return s.count if s else 0

    def render(self) -> list[str]:
        lines = self.header()
        for key, s in self.series.items():
            cumulative = 0
            for bound, n in zip((*self.buckets, math.inf), s.bucket_counts):
                cumulative += n
                labels = format_labels(self.label_names, key, {"le": format_value(bound)})
                lines.append(f"{self.name}_bucket{labels} {cumulative}")
            plain = format_labels(self.label_names, key)
            lines.append(f"{self.name}_sum{plain} {format_value(s.sum)}")
            lines.append(f"{self.name}_count{plain} {s.count}")
        return lines


class Registry:
    """An ordered set of metrics and the one lock that guards them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._metrics: dict[str, Counter | Gauge | Histogram] = {}

    def add(self, metric: Counter | Gauge | Histogram) -> Counter | Gauge | Histogram:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} registered twice")
        self._metrics[metric.name] = metric
        return metric

    def render(self) -> str:
        with self.lock:
            lines: list[str] = []
            for metric in self._metrics.values():
                lines.extend(metric.render())
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class EngineSnapshot:
    """What the engine thread publishes after each step: plain numbers, safe to read from any thread."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_preemptions: int = 0
    num_iterations: int = 0
    num_token_slots: int = 0
    num_recomputed_tokens: int = 0
    occupancy: float = 0.0
    idle_rows_by_reason: Mapping[str, int] = field(default_factory=dict)


class ServerMetrics:
    """Every series the server exports, labelled with ``model_name``."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = Registry()
        m = ("model_name",)
        self.num_requests_running = self._gauge(
            "vllm:num_requests_running", "Requests in the running batch.", m
        )
        self.num_requests_waiting = self._gauge(
            "vllm:num_requests_waiting", "Requests waiting to be admitted.", m
        )
        self.kv_cache_usage_perc = self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage: 1 means every block is in use.", m
        )
        self.num_preemptions = self._counter("vllm:num_preemptions_total", "Preemptions by recompute.", m)
        self.prompt_tokens = self._counter("vllm:prompt_tokens_total", "Prompt tokens prefilled.", m)
        self.generation_tokens = self._counter("vllm:generation_tokens_total", "Tokens generated.", m)
        self.request_success = self._counter(
            "vllm:request_success_total",
            "Requests finished, by finish reason.",
            ("model_name", "finished_reason"),
        )
        self.ttft = self._histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", m, TTFT_BUCKETS_S
        )
        self.itl = self._histogram(
            "vllm:inter_token_latency_seconds",
            "Time between successive outputs of one request.",
            m,
            ITL_BUCKETS_S,
        )
        self.e2e = self._histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to finish.", m, REQUEST_BUCKETS_S
        )
        self.queue_time = self._histogram(
            "vllm:request_queue_time_seconds",
            "Arrival to first admission into the batch.",
            m,
            REQUEST_BUCKETS_S,
        )
        # tokenmill's own
        self.build_info = self._gauge(
            "tokenmill:build_info",
            "Always 1; the labels say what runs: versions, the CPU, the kernel variant, the fast paths that are off.",
            ("model_name", "version", "torch", "cpu_model", "kernel_variant", "fast_paths_off"),
        )
        self.occupancy = self._gauge(
            "tokenmill:batch_occupancy", "Rows computed / rows possible over all iterations.", m
        )
        self.iterations = self._counter(
            "tokenmill:iterations_total", "Engine iterations that computed at least one row.", m
        )
        self.token_slots = self._counter("tokenmill:token_slots_total", "Row-iterations computed.", m)
        self.recomputed_tokens = self._counter(
            "tokenmill:recomputed_tokens_total", "Tokens computed again after a preemption.", m
        )
        self.idle_rows = self._counter(
            "tokenmill:idle_rows_total",
            "Rows that could have run but did not, by reason.",
            ("model_name", "reason"),
        )
        self.in_flight = self._gauge(
            "tokenmill:num_requests_in_flight", "Engine requests accepted and not yet finished.", m
        )
        self.queue_rejections = self._counter(
            "tokenmill:queue_rejections_total",
            "HTTP requests refused with 429 because the queue was full.",
            m,
        )
        self.engine_alive = self._gauge("tokenmill:engine_loop_alive", "1 while the engine loop runs.", m)
        self.free_blocks = self._gauge("tokenmill:kv_free_blocks", "Free blocks in the KV pool.", m)
        self.total_blocks = self._gauge("tokenmill:kv_total_blocks", "Blocks in the KV pool.", m)
        labels = self._labels
        for reason in ("stop", "length", "abort", "error"):
            self.request_success.inc((model_name, reason), 0.0)
        for metric in (self.num_preemptions, self.prompt_tokens, self.generation_tokens, self.iterations,
                       self.token_slots, self.recomputed_tokens, self.queue_rejections):  # fmt: skip
            metric.inc(labels, 0.0)
        for hist in (self.ttft, self.itl, self.e2e, self.queue_time):
            hist.touch(labels)
        self.update_engine(EngineSnapshot(), num_in_flight=0, alive=True)

    def _counter(self, name: str, help: str, labels: tuple[str, ...]) -> Counter:
        metric = Counter(name, help, labels)
        self.registry.add(metric)
        return metric

    def _gauge(self, name: str, help: str, labels: tuple[str, ...]) -> Gauge:
        metric = Gauge(name, help, labels)
        self.registry.add(metric)
        return metric

    def _histogram(
        self, name: str, help: str, labels: tuple[str, ...], buckets: tuple[float, ...]
    ) -> Histogram:
        metric = Histogram(name, help, labels, buckets=buckets)
        self.registry.add(metric)
        return metric

    @property
    def _labels(self) -> tuple[str]:
        return (self.model_name,)

    # --- engine thread -------------------------------------------------------------------------------
    def update_engine(self, snap: EngineSnapshot, num_in_flight: int, alive: bool) -> None:
        labels = self._labels
        with self.registry.lock:
            self.num_requests_running.set(labels, snap.num_running)
            self.num_requests_waiting.set(labels, snap.num_waiting)
            self.kv_cache_usage_perc.set(labels, snap.kv_cache_usage)
            self.num_preemptions.set_total(labels, snap.num_preemptions)
            self.occupancy.set(labels, snap.occupancy)
            self.iterations.set_total(labels, snap.num_iterations)
            self.token_slots.set_total(labels, snap.num_token_slots)
            self.recomputed_tokens.set_total(labels, snap.num_recomputed_tokens)
            for reason, n in snap.idle_rows_by_reason.items():
                self.idle_rows.set_total((self.model_name, reason), n)
            self.in_flight.set(labels, num_in_flight)
            self.engine_alive.set(labels, 1.0 if alive else 0.0)
            self.free_blocks.set(labels, snap.num_free_blocks)
            self.total_blocks.set(labels, snap.num_total_blocks)

    def observe_requests(self, events: Iterable[RequestEvent]) -> None:
        labels = self._labels
        with self.registry.lock:
            for ev in events:
                if ev.num_prompt_tokens:
                    self.prompt_tokens.inc(labels, ev.num_prompt_tokens)
                if ev.num_new_tokens:
                    self.generation_tokens.inc(labels, ev.num_new_tokens)
                if ev.queue_time_s is not None:
                    self.queue_time.observe(labels, ev.queue_time_s)
                if ev.ttft_s is not None:
                    self.ttft.observe(labels, ev.ttft_s)
                if ev.itl_s is not None:
                    self.itl.observe(labels, ev.itl_s)
                if ev.finish_reason is not None:
                    self.request_success.inc((self.model_name, ev.finish_reason))
                    if ev.e2e_s is not None:
                        self.e2e.observe(labels, ev.e2e_s)

    # --- HTTP thread ---------------------------------------------------------------------------------
    def set_build_info(self, info: Mapping[str, Any]) -> None:
        """``info`` from :func:`tokenmill.system_info.collect`."""
        off = ",".join(name for name, state in info["fast_paths"].items() if state.startswith("off"))
        labels = (
            self.model_name,
            info["tokenmill"],
            info["torch"],
            info["cpu_model"],
            info["kernel_variant"],
            off,
        )
        self.build_info.set(labels, 1.0)

    def count_rejection(self) -> None:
        with self.registry.lock:
            self.queue_rejections.inc(self._labels)

    def render(self) -> str:
        return self.registry.render()


@dataclass
class RequestEvent:
    """What one step did to one request, in the terms the histograms want (all optional)."""

    num_prompt_tokens: int = 0  # counted once, with the first output
    num_new_tokens: int = 0
    queue_time_s: float | None = None
    ttft_s: float | None = None
    itl_s: float | None = None
    finish_reason: str | None = None
    e2e_s: float | None = None
