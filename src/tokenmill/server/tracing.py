"""``--otlp-traces-endpoint URL``: one OpenTelemetry span per engine request, exported over OTLP.

The span is vLLM's: named ``llm_request``, kind SERVER, a child of the HTTP request's W3C ``traceparent`` when it
came with one, from the request's arrival to its end, with vLLM's attribute names (``gen_ai.request.*``,
``gen_ai.usage.*``, ``gen_ai.latency.*``; seconds). It is made when the request ends, from the engine's own
timestamps (``RequestMetrics``), and handed to the SDK's batch processor, whose thread exports it: the engine
thread never waits on the network.

The SDK is an optional extra (``pip install tokenmill[otel]``). The protocol is OTLP over HTTP/protobuf unless
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc``; the SDK's other ``OTEL_*`` variables (headers, timeouts) apply.
"""

from __future__ import annotations

import os
import time
from typing import Any

from tokenmill.outputs import RequestDelta
from tokenmill.server.observers import AddedRequest

SPAN_NAME = "llm_request"


def _require_sdk() -> Any:
    try:
        from opentelemetry.sdk import trace as sdk_trace
    except ImportError as exc:  # the extra is not installed
        raise ValueError(
            "--otlp-traces-endpoint needs the OpenTelemetry SDK: pip install 'tokenmill[otel]'"
        ) from exc
    return sdk_trace


def make_exporter(endpoint: str) -> Any:
    """The OTLP span exporter for ``endpoint`` (HTTP/protobuf, or gRPC by ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``)."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
        else:
            raise ValueError(
                f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be http/protobuf or grpc, got {protocol!r}"
            )
    except ImportError as exc:
        raise ValueError(
            f"--otlp-traces-endpoint over {protocol} needs its OTLP exporter: pip install 'tokenmill[otel]'"
        ) from exc
    return OTLPSpanExporter(endpoint=endpoint)


class RequestTracer:
    """An observer (``server/observers.py``) that turns each finished engine request into a span."""

    def __init__(self, endpoint: str | None, model_name: str, exporter: Any = None) -> None:
        sdk_trace = _require_sdk()
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.model_name = model_name
        self.provider = sdk_trace.TracerProvider(resource=Resource.create({"service.name": "tokenmill"}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter or make_exporter(str(endpoint))))
        self.tracer = self.provider.get_tracer("tokenmill")
        self.propagator = TraceContextTextMapPropagator()
        self._kind, self._status, self._code = SpanKind.SERVER, Status, StatusCode
        # the engine's clock (perf_counter) against the wall clock, for the spans' epoch timestamps
        self._offset_ns = time.time_ns() - int(time.perf_counter() * 1e9)

    def _wall_ns(self, clock_s: float) -> int:
        return self._offset_ns + int(clock_s * 1e9)

    def on_add(self, request: AddedRequest, now_s: float) -> None:
        pass

    def on_step(self, start_s: float, end_s: float, has_work: bool) -> None:
        pass

    def on_finish(self, request: AddedRequest, delta: RequestDelta) -> None:
        m = delta.metrics
        params = request.params
        attributes: dict[str, Any] = {
            "gen_ai.request.id": request.request_id,
            "gen_ai.response.model": self.model_name,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.n": 1,  # one span per engine request: each of n choices is its own
            "gen_ai.usage.prompt_tokens": len(request.prompt_token_ids),
            "gen_ai.usage.completion_tokens": m.num_output_tokens
            if m is not None
            else delta.num_output_tokens,
            "gen_ai.usage.cached_tokens": delta.num_cached_tokens,
            "gen_ai.response.finish_reasons": [delta.finish_reason or "stop"],
        }
        if m is not None:
            for name, value in (
                ("gen_ai.latency.time_in_queue", m.queue_time_s),
                ("gen_ai.latency.time_to_first_token", m.time_to_first_token_s),
                ("gen_ai.latency.e2e", m.e2e_time_s),
                ("gen_ai.latency.time_in_model_prefill", m.prefill_time_s),
                ("gen_ai.latency.time_in_model_decode", m.decode_time_s),
                ("gen_ai.latency.time_in_model_inference", _sum(m.prefill_time_s, m.decode_time_s)),
            ):
                if value is not None:
                    attributes[name] = value
            attributes["tokenmill.num_preemptions"] = m.num_preemptions
            attributes["tokenmill.num_recomputed_tokens"] = m.num_recomputed_tokens
        parent = self.propagator.extract(carrier=dict(request.trace_headers or {}))
        end_s = m.finished_time_s if m is not None and m.finished_time_s is not None else request.arrival_s
        span = self.tracer.start_span(
            SPAN_NAME,
            context=parent,
            kind=self._kind,
            attributes=attributes,
            start_time=self._wall_ns(request.arrival_s),
        )
        if delta.finish_reason == "error":
            span.set_status(self._status(self._code.ERROR, delta.error or "error"))
        span.end(end_time=max(self._wall_ns(end_s), self._wall_ns(request.arrival_s)))

    def close(self) -> None:
        self.provider.shutdown()  # flushes what the batch processor holds


def _sum(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b
