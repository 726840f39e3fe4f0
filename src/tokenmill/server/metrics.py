"""The server's Prometheus metrics, through ``prometheus_client`` (its registry, types and text format).

The engine thread observes; the HTTP thread renders. One lock guards both, so a scrape never sees a
histogram whose ``_count`` disagrees with its buckets, or a step's counters half updated. Names follow vLLM's
(``vllm:...``) so existing dashboards work; tokenmill's own series (occupancy, idle rows by reason) are
``tokenmill:...``. Each ServerMetrics has its own registry (no process-global state); ``_created`` series are
off, as in vLLM.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tokenmill.outputs import RequestMetrics
from tokenmill.stats import EngineStats

prometheus_client.disable_created_metrics()
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

# Bucket bounds in seconds, close to vLLM's; the latency ones share their upper part.
_LONG_S = (0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, *_LONG_S)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, *_LONG_S)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
ROOFLINE_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5)
REQUEST_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)  # fmt: skip


@dataclass(frozen=True)
class EngineSnapshot:
    """What the engine thread publishes after each step, safe to read from any thread: the live state (gauges)
    and a copy of the engine's own totals (:class:`~tokenmill.stats.EngineStats`, exported as they are)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    totals: EngineStats = field(default_factory=EngineStats)
    max_loras: int = 0  # LoRA: the slots (0: adapters off), and the adapters of running and waiting requests
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()


# The engine's totals (EngineStats fields) exported as they are by _EngineTotals: (name, help, field). The name
# is without "_total", which prometheus_client adds to a counter's sample.
ENGINE_TOTALS = (
    ("vllm:num_preemptions", "Preemptions by recompute.", "num_preemptions"),
    (
        "vllm:prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
        "num_prefix_queried_tokens",
    ),
    (
        "vllm:prefix_cache_hits",
        "Prompt tokens served from the prefix cache (not computed).",
        "num_prefix_hit_tokens",
    ),
    (
        "vllm:external_prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache's disk tier (past the memory tier).",
        "num_disk_queried_tokens",
    ),
    (
        "vllm:external_prefix_cache_hits",
        "Prompt tokens read back from the prefix cache's disk tier (not computed).",
        "num_disk_hit_tokens",
    ),
    ("tokenmill:kv_disk_stored_blocks", "KV blocks written to the disk tier.", "num_disk_stored_blocks"),
    ("tokenmill:kv_disk_evicted_blocks", "Disk-tier blocks removed by its bound.", "num_disk_evicted_blocks"),
    (
        "tokenmill:kv_disk_corrupt_blocks",
        "Disk-tier files refused by their length or checksum (deleted, computed again).",
        "num_disk_corrupt_blocks",
    ),
    (
        "tokenmill:kv_disk_failed_writes",
        "Blocks not written to the disk tier (the file system refused, or the write queue was full).",
        "num_disk_failed_writes",
    ),
    ("tokenmill:iterations", "Engine iterations that computed at least one row.", "num_iterations"),
    ("tokenmill:token_slots", "Row-iterations computed.", "num_token_slots"),
    ("tokenmill:recomputed_tokens", "Tokens computed again after a preemption.", "num_recomputed_tokens"),
    (
        "tokenmill:failed_steps",
        "Steps whose forward raised (their requests ended with an error).",
        "num_failed_steps",
    ),
    ("vllm:spec_decode_num_drafts", "Speculative verifications (rows with a proposal).", "num_spec_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Proposed tokens verified.", "num_spec_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted.", "num_spec_accepted_tokens"),
)


def _monotonic(previous: EngineStats, new: EngineStats) -> EngineStats:
    """``new`` with each total no smaller than it was: a counter never goes down, even if a snapshot lags."""
    totals = {attr: max(getattr(previous, attr), getattr(new, attr)) for _, _, attr in ENGINE_TOTALS}
    idle = dict(previous.idle_rows_by_reason)
    for reason, n in new.idle_rows_by_reason.items():
        idle[reason] = max(idle.get(reason, 0), n)
    per_pos = list(new.spec_accepted_per_pos)
    for i, n in enumerate(previous.spec_accepted_per_pos):
        if i < len(per_pos):
            per_pos[i] = max(per_pos[i], n)
        else:
            per_pos.append(n)
    return dataclasses.replace(new, idle_rows_by_reason=idle, spec_accepted_per_pos=per_pos, **totals)


class _EngineTotals(Collector):
    """The engine's own counters, read from its latest snapshot at each scrape: nothing is mirrored."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[CounterMetricFamily]:
        snap, name = self.metrics.totals, self.metrics.model_name
        for metric, help_text, attr in ENGINE_TOTALS:
            family = CounterMetricFamily(metric, help_text, labels=["model_name"])
            family.add_metric([name], float(getattr(snap, attr)))
            yield family
        idle = CounterMetricFamily(
            "tokenmill:idle_rows",
            "Rows that could have run but did not, by reason.",
            labels=["model_name", "reason"],
        )
        for reason, n in sorted(snap.idle_rows_by_reason.items()):
            idle.add_metric([name, reason], float(n))
        yield idle
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Proposed tokens accepted, by their position in the proposal (0 first).",
            labels=["model_name", "position"],
        )
        for position, n in enumerate(snap.spec_accepted_per_pos):
            per_pos.add_metric([name, str(position)], float(n))
        yield per_pos


class _ResponseStoreSeries(Collector):
    """The Responses API's store, read at each scrape: what it holds and what its caps pushed out."""

    def __init__(self, store: Any, model_name: str) -> None:
        self.store, self.model_name = store, model_name

    def collect(self) -> Iterable[Any]:
        for kind, name, help_text, value in (
            (GaugeMetricFamily, "tokenmill:responses_stored", "Responses held for previous_response_id.",
             len(self.store)),
            (GaugeMetricFamily, "tokenmill:responses_stored_bytes", "Bytes of the stored responses (JSON).",
             self.store.num_bytes),
            (CounterMetricFamily, "tokenmill:responses_evicted", "Stored responses evicted by the store's caps.",
             self.store.num_evicted),
            (CounterMetricFamily, "tokenmill:responses_not_stored",
             "Responses larger than the store's byte cap on their own, never stored.", self.store.num_refused),
        ):  # fmt: skip
            family = kind(name, help_text, labels=["model_name"])
            family.add_metric([self.model_name], float(value))
            yield family


class _ConstraintSeries(Collector):
    """The compiled-constraint cache and the compiles refused at their time budget, read at each scrape
    (zeros until the first constrained request builds the compiler)."""

    def __init__(self, compiler: Callable[[], Any], model_name: str) -> None:
        self.compiler, self.model_name = compiler, model_name

    def collect(self) -> Iterable[Any]:
        compiler = self.compiler()
        cache = compiler.cache if compiler is not None else None

        def read(attr: str) -> float:
            return float(getattr(cache, attr)) if cache is not None else 0.0

        for kind, name, help_text, value in (
            (GaugeMetricFamily, "tokenmill:constraint_cache_entries", "Translated grammars cached.",
             float(len(cache)) if cache is not None else 0.0),
            (GaugeMetricFamily, "tokenmill:constraint_cache_bytes", "Bytes of the cached grammars and keys.",
             read("num_bytes")),
            (CounterMetricFamily, "tokenmill:constraint_cache_hits", "Constraints found translated.", read("num_hits")),
            (CounterMetricFamily, "tokenmill:constraint_cache_misses", "Constraints translated.", read("num_misses")),
            (CounterMetricFamily, "tokenmill:constraint_cache_evictions",
             "Grammars evicted by the cache's byte bound (least recently used first).", read("num_evicted")),
            (CounterMetricFamily, "tokenmill:constraint_compile_timeouts",
             "Constraints refused because compiling them ran over the time budget.",
             float(compiler.num_compile_timeouts) if compiler is not None else 0.0),
        ):  # fmt: skip
            family = kind(name, help_text, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class ServerMetrics:
    """Every series the server exports, labelled with ``model_name``."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.lock = threading.Lock()
        self.totals = EngineStats()  # the engine's latest totals, read by _EngineTotals at each scrape
        self.registry.register(_EngineTotals(self))
        self._add_vllm_series()
        self._add_tokenmill_series()
        for reason in ("stop", "length", "abort", "error"):
            self.request_success.labels(model_name, reason)  # every series exists, at 0, from the start
        for counter in (self.prompt_tokens, self.generation_tokens, self.queue_rejections):
            counter.labels(model_name)
        for hist in (
            self.ttft,
            self.itl,
            self.e2e,
            self.queue_time,
            self.prefill_time,
            self.decode_time,
            self.inference_time,
            self.request_prompt_tokens,
            self.request_generation_tokens,
        ):
            hist.labels(model_name)  # fmt: skip
        self.update_engine(EngineSnapshot(), num_in_flight=0, alive=True)

    def _add_vllm_series(self) -> None:
        """The series vLLM exports, under its names (dashboards built for it work)."""
        self.num_requests_running = self._gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = self._gauge(
            "vllm:num_requests_waiting", "Requests waiting to be admitted."
        )
        self.lora_requests_info = Gauge(
            "vllm:lora_requests_info", "Running stats on LoRA requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=self.registry,
        )  # fmt: skip
        self.kv_cache_usage_perc = self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage: 1 means every block is in use."
        )
        self.prompt_tokens = self._counter("vllm:prompt_tokens_total", "Prompt tokens prefilled.")
        self.generation_tokens = self._counter("vllm:generation_tokens_total", "Tokens generated.")
        self.request_success = self._counter(
            "vllm:request_success_total",
            "Requests finished, by finish reason.",
            ("model_name", "finished_reason"),
        )
        self.ttft = self._histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS_S
        )
        self.itl = self._histogram(
            "vllm:inter_token_latency_seconds",
            "Time between successive outputs of one request.",
            ITL_BUCKETS_S,
        )
        self.e2e = self._histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS_S
        )
        self.queue_time = self._histogram(
            "vllm:request_queue_time_seconds", "Arrival to first admission into the batch.", REQUEST_BUCKETS_S
        )
        # per finished request, from the engine's RequestMetrics (the same numbers --enable-per-request-metrics sends)
        self.prefill_time = self._histogram(
            "vllm:request_prefill_time_seconds", "First admission to the first token.", REQUEST_BUCKETS_S
        )
        self.decode_time = self._histogram(
            "vllm:request_decode_time_seconds", "First token to last token.", REQUEST_BUCKETS_S
        )
        self.inference_time = self._histogram(
            "vllm:request_inference_time_seconds", "First admission to the last token.", REQUEST_BUCKETS_S
        )
        self.request_prompt_tokens = self._histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS
        )
        self.request_generation_tokens = self._histogram(
            "vllm:request_generation_tokens", "Generated tokens per finished request.", TOKEN_BUCKETS
        )

    def _add_tokenmill_series(self) -> None:
        self.build_info = self._gauge(
            "tokenmill:build_info",
            "Always 1; the labels say what runs: versions, the CPU, the kernel variant, the fast paths that are off.",
            ("model_name", "version", "torch", "cpu_model", "kernel_variant", "fast_paths_off"),
        )
        self.occupancy = self._gauge(
            "tokenmill:batch_occupancy", "Rows computed / rows possible over all iterations."
        )
        self.in_flight = self._gauge(
            "tokenmill:num_requests_in_flight", "Engine requests accepted and not yet finished."
        )
        self.queue_rejections = self._counter(
            "tokenmill:queue_rejections_total", "HTTP requests refused with 429 because the queue was full."
        )
        self.engine_alive = self._gauge("tokenmill:engine_loop_alive", "1 while the engine loop runs.")
        self.free_blocks = self._gauge("tokenmill:kv_free_blocks", "Free blocks in the KV pool.")
        self.step_roofline = Histogram(
            "tokenmill:step_roofline_fraction",
            "Each step's least possible time on this machine (its FLOPs and bytes at the measured or given "
            "peaks) over its wall time, by step kind: 1 is the machine's limit (--hardware-limits).",
            ("model_name", "kind"),
            buckets=ROOFLINE_BUCKETS,
            registry=self.registry,
        )
        self.total_blocks = self._gauge("tokenmill:kv_total_blocks", "Blocks in the KV pool.")

    def _counter(self, name: str, help: str, labels: tuple[str, ...] = ("model_name",)) -> Counter:
        return Counter(name, help, labels, registry=self.registry)

    def _gauge(self, name: str, help: str, labels: tuple[str, ...] = ("model_name",)) -> Gauge:
        return Gauge(name, help, labels, registry=self.registry)

    def _histogram(self, name: str, help: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, help, ("model_name",), buckets=buckets, registry=self.registry)

    def value(self, name: str, **labels: str) -> float:
        """One sample's current value (0 when absent), for tests and the engine's own checks."""
        value = self.registry.get_sample_value(name, {"model_name": self.model_name, **labels})
        return 0.0 if value is None else value

    # --- engine thread -------------------------------------------------------------------------------
    def update_engine(
        self, snap: EngineSnapshot, num_in_flight: int, alive: bool, num_failed_steps: int = 0
    ) -> None:
        labels = (self.model_name,)
        with self.lock:
            self.totals = _monotonic(
                self.totals, dataclasses.replace(snap.totals, num_failed_steps=num_failed_steps)
            )
            self.num_requests_running.labels(*labels).set(snap.num_running)
            self.num_requests_waiting.labels(*labels).set(snap.num_waiting)
            self.kv_cache_usage_perc.labels(*labels).set(snap.kv_cache_usage)
            self.occupancy.labels(*labels).set(snap.totals.occupancy)
            self.in_flight.labels(*labels).set(num_in_flight)
            self.engine_alive.labels(*labels).set(1.0 if alive else 0.0)
            self.free_blocks.labels(*labels).set(snap.num_free_blocks)
            self.total_blocks.labels(*labels).set(snap.num_total_blocks)
            if (
                snap.max_loras
            ):  # vLLM's: one series, its labels the adapters now, its value the time of the update
                self.lora_requests_info.clear()
                self.lora_requests_info.labels(
                    str(snap.max_loras), ",".join(snap.waiting_loras), ",".join(snap.running_loras)
                ).set_to_current_time()

    def _observe_finished(self, m: RequestMetrics) -> None:
        name = self.model_name
        self.request_prompt_tokens.labels(name).observe(m.num_prompt_tokens)
        self.request_generation_tokens.labels(name).observe(m.num_output_tokens)
        for hist, value in (
            (self.prefill_time, m.prefill_time_s),
            (self.decode_time, m.decode_time_s),
            (self.inference_time, None if m.prefill_time_s is None or m.decode_time_s is None
             else m.prefill_time_s + m.decode_time_s),
        ):  # fmt: skip
            if value is not None:
                hist.labels(name).observe(value)

    def observe_step(self, kind: str | None, roofline_fraction: float | None) -> None:
        if kind is None or roofline_fraction is None:
            return
        with self.lock:
            self.step_roofline.labels(self.model_name, kind).observe(roofline_fraction)

    def observe_requests(self, events: Iterable[RequestEvent]) -> None:
        name = self.model_name
        with self.lock:
            for ev in events:
                if ev.num_prompt_tokens:
                    self.prompt_tokens.labels(name).inc(ev.num_prompt_tokens)
                if ev.num_new_tokens:
                    self.generation_tokens.labels(name).inc(ev.num_new_tokens)
                if ev.queue_time_s is not None:
                    self.queue_time.labels(name).observe(ev.queue_time_s)
                if ev.ttft_s is not None:
                    self.ttft.labels(name).observe(ev.ttft_s)
                if ev.itl_s is not None:
                    self.itl.labels(name).observe(ev.itl_s)
                if ev.finish_reason is not None:
                    self.request_success.labels(name, ev.finish_reason).inc()
                    if ev.e2e_s is not None:
                        self.e2e.labels(name).observe(ev.e2e_s)
                    if ev.metrics is not None:
                        self._observe_finished(ev.metrics)

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
        with self.lock:
            self.build_info.labels(*labels).set(1.0)

    def watch_response_store(self, store: Any) -> None:
        """Export the Responses API store's size and evictions (``tokenmill:responses_*``)."""
        self.registry.register(_ResponseStoreSeries(store, self.model_name))

    def watch_constraints(self, compiler: Callable[[], Any]) -> None:
        """Export the constraint compiler's cache and time-outs (``tokenmill:constraint_*``); ``compiler``
        returns it, or None while none is built."""
        self.registry.register(_ConstraintSeries(compiler, self.model_name))

    def count_rejection(self) -> None:
        with self.lock:
            self.queue_rejections.labels(self.model_name).inc()

    def render(self) -> str:
        with self.lock:
            return prometheus_client.generate_latest(self.registry).decode()


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
    metrics: RequestMetrics | None = None  # the engine's, with the finish
