"""A long prompt whose client hangs up, then a short request: how long the short one waits, per step budget.

    python benchmarks/bench_long_prompt.py [--budgets 2048,default] [--prompt-words 1400] [--aborts 20]

For each ``--max-num-batched-tokens`` budget (``default``: the engine's own, 512 on CPU) a ``tokenmill serve``
process is started on the embedded model, and:

1. a short completion (8 tokens) is timed alone, best of 3;
2. a long prompt is streamed and dropped after ``--drop-after-s``, and the same short completion sent at once:
   its latency over the alone figure is the ratio printed (the long prompt's steps stand in its way until
   the abort takes effect, which is at the next step boundary);
3. ``--aborts`` long prompts sent and dropped in a row, then the server must be idle with every KV block free
   (``vllm:num_requests_running`` and ``vllm:kv_cache_usage_perc`` both 0 within 30 s).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def _short(base: str) -> float:
    t0 = time.perf_counter()
    r = httpx.post(
        f"{base}/v1/completions",
        json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
        timeout=120,
    )
    r.raise_for_status()
    return time.perf_counter() - t0


def _drop_long(base: str, prompt: str, after_s: float) -> None:
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True}
    with httpx.Client(timeout=120) as client, client.stream("POST", f"{base}/v1/completions", json=body):
        time.sleep(after_s)  # leaving the block closes the connection: the client is gone


def run_budget(budget: str, args: argparse.Namespace) -> dict[str, float]:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    flags = ["--port", str(port), "--max-model-len", "2048", "--log-level", "warning", "--no-access-log"]
    if budget != "default":
        flags += ["--max-num-batched-tokens", budget]
    log = tempfile.NamedTemporaryFile(prefix="bench-long-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.server.launch", *flags], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start; log: {log.name}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        prompt = " ".join(["word"] * args.prompt_words)
        num_prompt_tokens = httpx.post(f"{base}/tokenize", json={"prompt": prompt}, timeout=30).json()[
            "count"
        ]
        _short(base)  # warm-up
        alone_s = min(_short(base) for _ in range(3))
        _drop_long(base, prompt, args.drop_after_s)
        behind_s = _short(base)
        for _ in range(args.aborts):
            _drop_long(base, prompt, args.drop_after_s / 4)
        idle_deadline = time.monotonic() + 30
        while time.monotonic() < idle_deadline:
            running = _metric(base, "vllm:num_requests_running")
            usage = _metric(base, "vllm:kv_cache_usage_perc")
            if running == 0 and usage == 0:
                break
            time.sleep(0.2)
        return {
            "num_prompt_tokens": num_prompt_tokens,
            "alone_s": alone_s,
            "behind_s": behind_s,
            "ratio": behind_s / alone_s,
            "running_after_aborts": running,
            "kv_usage_after_aborts": usage,
        }
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
        os.unlink(log.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", default="2048,default")
    parser.add_argument("--prompt-words", type=int, default=1700)
    parser.add_argument("--drop-after-s", type=float, default=0.25)
    parser.add_argument("--aborts", type=int, default=20)
    args = parser.parse_args()
    for budget in args.budgets.split(","):
        r = run_budget(budget, args)
        print(
            f"max_num_batched_tokens={budget}: long prompt {r['num_prompt_tokens']:.0f} tokens; short request "
            f"alone {r['alone_s']:.2f} s, behind a dropped long prompt {r['behind_s']:.2f} s "
            f"(ratio {r['ratio']:.1f}); after {args.aborts} dropped long prompts: "
            f"{r['running_after_aborts']:.0f} running, KV usage {r['kv_usage_after_aborts']:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
