"""A bounded soak of a real ``tokenmill serve`` (default settings, the embedded model unless ``--model``): a
mixed load of well-formed requests (completions, chat streamed and cut mid-way, structured outputs, Responses
chains, Messages streams) and hostile ones (schemas, grammars and regexes past the limits, lone surrogates,
text longer than the context, 100 distinct large schemas), then what the server holds at the end.

Prints: requests sent, answers by status, 5xx (must be 0), refused with 429, requests running and KV usage at
the end (must be 0), the server's RSS at the start, after the large schemas and at the end, /health.

    python -m benchmarks.soak --seconds 120 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

M = [{"role": "user", "content": "Write one short sentence about rivers."}]


def _rss_mb(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"VmRSS:\s+(\d+) kB", text)
    return int(match.group(1)) / 1024 if match else float("nan")


def _chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {
        f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)
    }
    defs[f"d{n}"] = {"type": "string"}
    return {"type": "object", "properties": {"a": {"$ref": "#/$defs/d0"}}, "$defs": defs}


def _large_schema(seed: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {f"f{seed}_{i}": {"type": "string", "description": "d" * 300} for i in range(600)},
    }


def hostile(rng: random.Random, model: str) -> tuple[str, bytes]:
    """One hostile body (path, raw JSON)."""
    lark = "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1}' for i in range(5000)) + '\nr5000: "b"'
    bodies: list[tuple[str, Any]] = [
        ("/v1/chat/completions", {"messages": M, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _chain(1000)}}}),
        ("/v1/completions", {"prompt": "x", "guided_grammar": lark}),
        ("/v1/completions", {"prompt": "x", "guided_regex": "((a{100}){100}){100}"}),
        ("/v1/completions", {"prompt": "x", "guided_choice": [f"c{i}" for i in range(100_000)]}),
        ("/v1/completions", {"prompt": "x", "guided_json": '{"properties": {"a": ' * 2000 + "{}" + "}}" * 2000}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}),
        ("/v1/messages/count_tokens", {"model": model, "messages": M, "system": "word " * 1_000_000}),
        ("/tokenize", {"prompt": "word " * 1_000_000}),
        ("/v1/responses", {"input": "x", "metadata": {f"k{i}": "v" for i in range(40)}}),
    ]  # fmt: skip
    path, body = rng.choice(bodies)
    return path, json.dumps(body).encode()


async def good(client: httpx.AsyncClient, rng: random.Random, model: str, chains: list[str]) -> int:
    kind = rng.randrange(6)
    if kind == 0:
        r = await client.post(
            "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": rng.randint(4, 24)}
        )
    elif kind == 1:  # a stream cut mid-way
        async with client.stream(
            "POST", "/v1/chat/completions", json={"messages": M, "max_tokens": 48, "stream": True}
        ) as r:
            async for i, _ in _enumerate(r.aiter_lines()):
                if i > rng.randint(2, 8):
                    break
        return r.status_code
    elif kind == 2:
        schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
        r = await client.post("/v1/chat/completions", json={"messages": M, "max_tokens": 24, "response_format": {
            "type": "json_schema", "json_schema": {"name": "p", "schema": schema}}})  # fmt: skip
    elif kind == 3:  # a Responses chain
        body: dict[str, Any] = {"input": "Name a colour.", "max_output_tokens": 8}
        if chains and rng.random() < 0.6:
            body["previous_response_id"] = rng.choice(chains)
        r = await client.post("/v1/responses", json=body)
        if r.status_code == 200:
            chains.append(r.json()["id"])
            del chains[:-20]
    elif kind == 4:
        async with client.stream(
            "POST", "/v1/messages", json={"model": model, "max_tokens": 16, "messages": M, "stream": True}
        ) as r:
            async for _ in r.aiter_lines():
                pass
        return r.status_code
    else:
        r = await client.post(
            "/v1/chat/completions", json={"messages": M, "max_tokens": 8, "guided_choice": ["yes", "no"]}
        )
    return r.status_code


async def _enumerate(lines: Any) -> Any:
    i = 0
    async for line in lines:
        yield i, line
        i += 1


async def soak(base_url: str, seconds: float, concurrency: int, model: str) -> Counter[str]:
    counts: Counter[str] = Counter()
    chains: list[str] = []
    deadline = time.monotonic() + seconds

    async def worker(seed: int) -> None:
        rng = random.Random(seed)
        async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
            while time.monotonic() < deadline:
                try:
                    if rng.random() < 0.3:
                        path, raw = hostile(rng, model)
                        status = (
                            await client.post(path, content=raw, headers={"content-type": "application/json"})
                        ).status_code
                    else:
                        status = await good(client, rng, model, chains)
                except httpx.HTTPError as exc:
                    counts[f"transport error {type(exc).__name__}"] += 1
                    continue
                counts["requests"] += 1
                counts[str(status)] += 1

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return counts


def _metric(base_url: str, name: str) -> float:
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--model", default=None, help="a model tokenmill serve takes (default: the embedded one)"
    )
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}"
    store = Path(tempfile.mkdtemp()) / "responses.sqlite3"
    cmd = [sys.executable, "-m", "tokenmill.server.launch", "--port", str(port), "--log-level", "warning",
           "--no-access-log", "--response-store", f"sqlite:{store}", *(["--model", args.model] if args.model else [])]  # fmt: skip
    proc = subprocess.Popen(cmd)
    try:
        while True:
            try:
                if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        model = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        rss_start = _rss_mb(proc.pid)
        for seed in range(100):  # 100 distinct large schemas (~200 KB each), the cache's bound in force
            body = {"prompt": "x", "max_tokens": 1, "guided_json": _large_schema(seed)}
            httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
        rss_schemas = _rss_mb(proc.pid)
        started = time.monotonic()
        samples: list[float] = []
        done = threading.Event()

        def sample() -> None:
            while not done.wait(args.seconds / 10):
                samples.append(_rss_mb(proc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        counts = asyncio.run(soak(base_url, args.seconds, args.concurrency, model))
        done.set()
        elapsed = time.monotonic() - started
        time.sleep(2)
        running = _metric(base_url, "vllm:num_requests_running")
        usage = _metric(base_url, "vllm:kv_cache_usage_perc")
        health = httpx.get(f"{base_url}/health", timeout=10).status_code
        rss_end = _rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(60)
    num_5xx = sum(n for k, n in counts.items() if k.isdigit() and int(k) >= 500)
    print(f"soak: {counts['requests']} requests in {elapsed:.0f} s, concurrency {args.concurrency}")
    print(
        "  answers by status: " + ", ".join(f"{k}: {n}" for k, n in sorted(counts.items()) if k != "requests")
    )
    print(f"  5xx: {num_5xx}; refused 429: {counts.get('429', 0)}")
    print(f"  at the end: running {running:g}, KV usage {usage:g}, /health {health}")
    print(
        f"  server RSS: start {rss_start:.0f} MB, after 100 large schemas {rss_schemas:.0f} MB, end {rss_end:.0f} MB"
    )
    print("  RSS every tenth of the soak (MB): " + " ".join(f"{x:.0f}" for x in samples))
    return 0 if num_5xx == 0 and running == 0 and health == 200 else 1


if __name__ == "__main__":
    raise SystemExit(main())
