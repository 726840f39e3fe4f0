"""``tokenmill bench serve``: Poisson arrivals against a running OpenAI-compatible server, over HTTP.

Each request is a streamed ``/v1/completions`` call with a fixed-length prompt (token ids cut from a text
the server tokenized, so the length is exact on any model) and ``max_tokens=--output-len`` with
``ignore_eos``, so every request asks for the same work. From the chunks' arrival times, per request:

    TTFT   first text chunk - send                 time to first token
    ITL    gap between successive text chunks      inter-token latency (one per chunk)
    TPOT   (E2EL - TTFT) / (output tokens - 1)     time per output token after the first
    E2EL   last byte - send                        end-to-end latency

Reported as mean, median and p99 in milliseconds, with request and token throughput over the benchmark's
wall-clock duration and, when SLOs are given (``--slo-ttft-ms``, ``--slo-tpot-ms``, ``--slo-e2el-ms``),
goodput: requests per second that met every one of them. Arrivals: exponential gaps at
``--request-rate`` per second (``inf`` sends all at once), optionally capped at ``--max-concurrency``
requests in flight. Times are the wall clock of this client machine; counts are exact.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

SEED_TEXT = (
    "The history of computing is a story of people who wanted to calculate faster than they could by hand. "
    "Mechanical calculators gave way to relays, relays to vacuum tubes, and tubes to transistors, each step "
    "making machines smaller, cheaper and more reliable. Programs moved from plugboards to punched cards to "
    "stored memory, and languages rose from raw machine code to assemblers and then to compilers that let a "
    "person describe a problem rather than the wiring of a solution. Networks joined the machines together, "
    "and the web put a library, a marketplace and a post office on every desk. "
)
FALLBACK_TOKEN_RANGE = (1000, 10000)  # used only when the server has no /tokenize


@dataclass
class RequestResult:
    success: bool
    prompt_len: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    start_s: float = 0.0  # send time, relative to the benchmark's start
    error: str | None = None
    server_metrics: dict[str, Any] | None = None  # the server's own timings (--enable-per-request-metrics)

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class BenchConfig:
    base_url: str
    model: str | None = None
    api_key: str | None = None
    endpoint: str = "/v1/completions"
    num_prompts: int = 100
    request_rate: float = math.inf
    max_concurrency: int | None = None
    input_len: int = 128
    output_len: int = 64
    seed: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_e2el_ms: float | None = None
    timeout_s: float = 600.0
    # vLLM's random dataset knobs: lengths uniform in [len * (1 - r), len * (1 + r)]; a prefix every prompt shares
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0

    def __post_init__(self) -> None:
        for name in ("num_prompts", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ValueError(f"random_range_ratio must be in [0, 1), got {self.random_range_ratio}")
        if self.random_prefix_len < 0:
            raise ValueError(f"random_prefix_len must be >= 0, got {self.random_prefix_len}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")

    def lengths(self) -> list[tuple[int, int]]:
        """Each request's (prompt length after the shared prefix, output length); their own generator, so the
        prompts' draws stay as they were without ``random_range_ratio``."""
        r, rng = self.random_range_ratio, random.Random(self.seed + 7919)

        def draw(n: int) -> int:
            return max(1, rng.randint(int(n * (1 - r)), int(n * (1 + r)))) if r else n

        return [(draw(self.input_len), draw(self.output_len)) for _ in range(self.num_prompts)]


# --- pure parts ------------------------------------------------------------------------------------------


def poisson_arrivals(num: int, rate: float, rng: random.Random) -> list[float]:
    """Send times (seconds from the start) of ``num`` requests with exponential gaps of mean 1/rate."""
    if math.isinf(rate):
        return [0.0] * num
    times, t = [], 0.0
    for _ in range(num):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation, as numpy's default; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _stats_ms(values_s: Sequence[float]) -> dict[str, float]:
    ms = [v * 1000.0 for v in values_s]
    return {
        "mean": sum(ms) / len(ms) if ms else 0.0,
        "median": percentile(ms, 50),
        "p99": percentile(ms, 99),
    }


def meets_slo(r: RequestResult, cfg: BenchConfig) -> bool:
    if not r.success:
        return False
    if cfg.slo_ttft_ms is not None and r.ttft_s * 1000 > cfg.slo_ttft_ms:
        return False
    tpot = r.tpot_s
    if cfg.slo_tpot_ms is not None and tpot is not None and tpot * 1000 > cfg.slo_tpot_ms:
        return False
    return not (cfg.slo_e2el_ms is not None and r.e2el_s * 1000 > cfg.slo_e2el_ms)


def summarize(results: Sequence[RequestResult], duration_s: float, cfg: BenchConfig) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    duration_s = max(duration_s, 1e-9)
    slos = {
        k: v
        for k, v in (("ttft_ms", cfg.slo_ttft_ms), ("tpot_ms", cfg.slo_tpot_ms), ("e2el_ms", cfg.slo_e2el_ms))
        if v is not None
    }
    num_good = sum(1 for r in ok if meets_slo(r, cfg)) if slos else None
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            key = (r.error or "unknown")[:120]
            errors[key] = errors.get(key, 0) + 1
    return {
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
        "max_concurrency": cfg.max_concurrency,
        "input_len": cfg.input_len,
        "output_len": cfg.output_len,
        "random_range_ratio": cfg.random_range_ratio,
        "random_prefix_len": cfg.random_prefix_len,
        "duration_s": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput_rps": len(ok) / duration_s,
        "output_throughput_tps": total_output / duration_s,
        "total_token_throughput_tps": (total_input + total_output) / duration_s,
        "slo": slos,
        "num_good": num_good,
        "goodput_rps": None if num_good is None else num_good / duration_s,
        "ttft_ms": _stats_ms([r.ttft_s for r in ok]),
        "tpot_ms": _stats_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": _stats_ms([gap for r in ok for gap in r.itl_s]),
        "e2el_ms": _stats_ms([r.e2el_s for r in ok]),
        "server": _server_side(ok),
        "errors": errors,
    }


SERVER_TIMES_MS = ("queue_time_ms", "prefill_time_ms", "decode_time_ms", "e2e_time_ms")
SERVER_COUNTS = ("num_cached_tokens", "num_preemptions", "num_recomputed_tokens")


def _server_side(ok: Sequence[RequestResult]) -> dict[str, Any] | None:
    """What the server measured itself (``--enable-per-request-metrics``): its time splits' percentiles and
    the counts summed; None when it sent none."""
    reported = [r.server_metrics for r in ok if r.server_metrics]
    if not reported:
        return None
    out: dict[str, Any] = {"num_reported": len(reported)}
    for key in SERVER_TIMES_MS:
        out[key] = _stats_ms([m[key] / 1000.0 for m in reported if m.get(key) is not None])
    for key in SERVER_COUNTS:
        out[key] = sum(int(m.get(key) or 0) for m in reported)
    return out


def format_report(s: dict[str, Any]) -> str:
    def row(label: str, value: Any) -> str:
        if isinstance(value, float):
            value = f"{value:.2f}"
        return f"{label:<40}{value:>12}"

    lines = [
        "=" * 17 + " Serving benchmark " + "=" * 16,
        row("Successful requests:", s["completed"]),
        row("Failed requests:", s["failed"]),
        row("Request rate (req/s):", s["request_rate"]),
        row("Max concurrency:", s["max_concurrency"] or "none"),
        row(
            "Input / output tokens per request:",
            f"{s['input_len']} / {s['output_len']}"
            + (f" (x 1 +- {s['random_range_ratio']:g})" if s.get("random_range_ratio") else ""),
        ),
        *([row("Shared prefix tokens:", s["random_prefix_len"])] if s.get("random_prefix_len") else []),
        row("Benchmark duration (s):", s["duration_s"]),
        row("Total input tokens:", s["total_input_tokens"]),
        row("Total generated tokens:", s["total_output_tokens"]),
        row("Request throughput (req/s):", s["request_throughput_rps"]),
        row("Output token throughput (tok/s):", s["output_throughput_tps"]),
        row("Total token throughput (tok/s):", s["total_token_throughput_tps"]),
    ]
    if s["goodput_rps"] is not None:
        slo = ", ".join(f"{k} <= {v:g}" for k, v in s["slo"].items())
        lines.append(row("Request goodput (req/s):", s["goodput_rps"]))
        lines.append(row("Requests meeting the SLOs:", f"{s['num_good']}/{s['num_prompts']}"))
        lines.append(f"  SLOs: {slo}")
    for key, title in (
        ("ttft_ms", "Time to first token"),
        ("tpot_ms", "Time per output token (after the first)"),
        ("itl_ms", "Inter-token latency"),
        ("e2el_ms", "End-to-end latency"),
    ):
        name = key.split("_")[0].upper()
        lines.append(f"{'-' * 4} {title} {'-' * max(1, 47 - len(title))}")
        for stat in ("mean", "median", "p99"):
            lines.append(row(f"{stat.capitalize() if stat != 'p99' else 'P99'} {name} (ms):", s[key][stat]))
    server = s.get("server")
    if server:
        title = f"Server's own timings ({server['num_reported']} requests)"
        lines.append(f"{'-' * 4} {title} {'-' * max(1, 47 - len(title))}")
        for key in SERVER_TIMES_MS:
            label = key.removesuffix("_ms").replace("_", " ").capitalize()
            lines.append(
                row(f"{label} mean / p99 (ms):", f"{server[key]['mean']:.1f} / {server[key]['p99']:.1f}")
            )
        lines.append(row("Cached prompt tokens:", server["num_cached_tokens"]))
        lines.append(row("Preemptions / recomputed tokens:",
                         f"{server['num_preemptions']} / {server['num_recomputed_tokens']}"))  # fmt: skip
    if s["errors"]:
        lines.append("---- Errors " + "-" * 40)
        lines.extend(f"  {n} x {msg}" for msg, n in s["errors"].items())
    lines.append("=" * 52)
    return "\n".join(lines)


# --- the client ------------------------------------------------------------------------------------------


async def _fetch_model(client: httpx.AsyncClient) -> str:
    r = await client.get("/v1/models")
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


async def make_prompts(
    client: httpx.AsyncClient, cfg: BenchConfig, model: str, rng: random.Random
) -> list[list[int]]:
    """``num_prompts`` prompts of ``input_len`` token ids (or as ``cfg.lengths()`` draws them, after the shared
    ``random_prefix_len`` ones), each a window of the tokenized seed text."""
    try:
        r = await client.post(
            "/tokenize", json={"model": model, "prompt": SEED_TEXT, "add_special_tokens": False}
        )
        r.raise_for_status()
        pool = [int(t) for t in r.json()["tokens"]]
    except (httpx.HTTPError, KeyError, ValueError):
        pool = []
    lengths = [n for n, _ in cfg.lengths()]
    if len(pool) < 8:
        lo, hi = FALLBACK_TOKEN_RANGE
        prefix = [rng.randrange(lo, hi) for _ in range(cfg.random_prefix_len)]
        return [prefix + [rng.randrange(lo, hi) for _ in range(n)] for n in lengths]
    prefix = [pool[i % len(pool)] for i in range(cfg.random_prefix_len)]
    prompts = []
    for n in lengths:
        start = rng.randrange(len(pool))
        prompts.append(prefix + [pool[(start + i) % len(pool)] for i in range(n)])
    return prompts


async def send_one(
    client: httpx.AsyncClient,
    cfg: BenchConfig,
    model: str,
    prompt: list[int] | str,
    t0: float,
    max_tokens: int | None = None,
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens or cfg.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(success=False, prompt_len=len(prompt))
    start = time.perf_counter()
    result.start_s = start - t0
    last = start
    num_chunks = 0
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", cfg.endpoint, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                result.error = f"HTTP {r.status_code}: {text[:200]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: ") :]
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(payload)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))
                    return result
                if chunk.get("usage"):
                    usage_tokens = int(chunk["usage"]["completion_tokens"])
                if isinstance(chunk.get("metrics"), dict):
                    result.server_metrics = chunk["metrics"]
                if any(c.get("text") for c in chunk.get("choices") or []):
                    if num_chunks == 0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    num_chunks += 1
        result.e2el_s = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.output_tokens = usage_tokens if usage_tokens is not None else num_chunks
    result.success = num_chunks > 0
    if not result.success:
        result.error = "no tokens received"
    return result


async def run_benchmark(
    cfg: BenchConfig, transport: httpx.AsyncBaseTransport | None = None
) -> tuple[list[RequestResult], float, str]:
    """Run the benchmark; returns per-request results, the duration in seconds and the model name."""
    rng = random.Random(cfg.seed)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(
        max_connections=cfg.max_concurrency or cfg.num_prompts, max_keepalive_connections=64
    )
    async with httpx.AsyncClient(
        base_url=cfg.base_url, headers=headers, timeout=cfg.timeout_s, limits=limits, transport=transport
    ) as client:
        model = cfg.model or await _fetch_model(client)
        prompts = await make_prompts(client, cfg, model, rng)
        arrivals = poisson_arrivals(cfg.num_prompts, cfg.request_rate, rng)
        gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        t0 = time.perf_counter()

        outputs = [n for _, n in cfg.lengths()]

        async def launch(prompt: list[int], at_s: float, max_tokens: int) -> RequestResult:
            delay = t0 + at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if gate is None:
                return await send_one(client, cfg, model, prompt, t0, max_tokens)
            async with gate:
                return await send_one(client, cfg, model, prompt, t0, max_tokens)

        results = await asyncio.gather(
            *(launch(p, at, n) for p, at, n in zip(prompts, arrivals, outputs, strict=True))
        )
        duration_s = time.perf_counter() - t0
    return list(results), duration_s, model


# --- CLI -------------------------------------------------------------------------------------------------


def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="the server's root URL (default: http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1", help="the server's address")
    parser.add_argument("--port", type=int, default=8000, help="the server's port")
    parser.add_argument("--endpoint", default="/v1/completions", help="the route the requests go to")
    parser.add_argument(
        "--model", default=None, help="model name to send (default: the server's first model)"
    )
    parser.add_argument(
        "--api-key", default=None, help="bearer key (default: $TOKENMILL_API_KEY or $OPENAI_API_KEY)"
    )
    parser.add_argument("--num-prompts", type=int, default=100, help="requests in the run")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="mean arrivals per second, Poisson (default: inf, all at once)",
    )
    parser.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument(
        "--output-len", type=int, default=64, help="generated tokens per request (ignore_eos)"
    )
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="vLLM's: input and output lengths uniform in [len * (1 - r), len * (1 + r)] (default 0: fixed)",
    )
    parser.add_argument(
        "--random-prefix-len", type=int, default=0, help="vLLM's: tokens every prompt starts with (shared)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the seed of the prompts and the arrival times")
    parser.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO on time to first token")
    parser.add_argument(
        "--slo-tpot-ms", type=float, default=None, help="goodput SLO on time per output token"
    )
    parser.add_argument("--slo-e2el-ms", type=float, default=None, help="goodput SLO on end-to-end latency")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="write the summary as JSON to PATH (or, with no PATH, print JSON instead of the table)",
    )


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        base_url=(args.base_url or f"http://{args.host}:{args.port}").rstrip("/"),
        model=args.model,
        api_key=args.api_key or os.environ.get("TOKENMILL_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        endpoint=args.endpoint,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=args.seed,
        random_range_ratio=args.random_range_ratio,
        random_prefix_len=args.random_prefix_len,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        slo_e2el_ms=args.slo_e2el_ms,
        timeout_s=args.timeout,
    )


def run_bench_serve(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    try:
        results, duration_s, model = asyncio.run(run_benchmark(cfg))
    except httpx.HTTPError as exc:
        print(f"tokenmill bench serve: cannot reach {cfg.base_url}: {exc}", file=sys.stderr)
        return 1
    summary = summarize(results, duration_s, cfg)
    summary["model"] = model
    summary["base_url"] = cfg.base_url
    if args.json == "-":
        print(json.dumps(summary, indent=2))
    else:
        print(format_report(summary))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**summary, "requests": [asdict(r) for r in results]}, f, indent=2)
    return 0 if summary["completed"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill bench serve", description=__doc__.split("\n\n")[0])
    add_bench_serve_arguments(parser)
    return run_bench_serve(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
