"""Prefill on every thread against one thread: how much of the second core a prefill turns into speed.

    python -m benchmarks.thread_scaling [--model NAME] [--tokens 1024] [--rounds 4] [--quantization gguf]

Two engines in one process, one with ``num_threads=1`` and one with every thread (torch's count), both fixed
(``adaptive_threads=False``), prefix caching and speculation off; each round times one prefill of ``--tokens``
tokens of Python's standard library source (``benchmarks.arithmetic_quality.code_text``) in each engine, the order
alternating from round to round. Prints each engine's times, their medians, the medians' ratio and the median of
the rounds' own ratios (the speedup; ideal: the thread count). On a quiet machine a prefill's matmuls scale with the
cores; on a shared one the host slows a core now and then, and a split that waits for its slowest share shows it
here first.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

import torch

from benchmarks.arithmetic_quality import code_text
from benchmarks.common import cpu_name
from benchmarks.prefill_decode import timed_request


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="qwen2.5-coder-1.5b-instruct", help="a pulled model's name or a path"
    )
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--quantization", default=None, help="the engine's quantization (default: the model's)"
    )
    args = parser.parse_args(argv)
    from tokenmill.engine import Engine
    from tokenmill.model.registry import resolve
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.tokenizer import Tokenizer

    model = resolve(args.model)
    ids = Tokenizer.from_gguf(model).encode(code_text(), add_special_tokens=False)
    if len(ids) < 1000 + args.tokens:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {1000 + args.tokens}")
    prompt = ids[1000 : 1000 + args.tokens]
    max_threads = torch.get_num_threads()
    counts = (1, max_threads)
    engines: dict[int, Any] = {}
    for n in counts:
        engines[n] = Engine(
            model=model,
            num_threads=n,
            adaptive_threads=False,
            enable_prefix_caching=False,
            speculative_config={"method": "none"},
            quantization=args.quantization,
            max_num_batched_tokens=max(2048, args.tokens),
        )
        engines[n].generate([[100, 101, 102, 103] * 8], SamplingParams(max_tokens=4, temperature=0))
        timed_request(engines[n], prompt, 1)  # warm: the buffers a prefill of this size grows
    times: dict[int, list[float]] = {n: [] for n in counts}
    for r in range(args.rounds):
        for n in counts if r % 2 == 0 else counts[::-1]:
            times[n].append(timed_request(engines[n], prompt, 1)[0])
    print(
        f"{cpu_name()}, {os.cpu_count()} cores; {args.model}, {args.tokens}-token prefill, {args.rounds} rounds"
    )
    for n in counts:
        t = times[n]
        print(
            f"{n} thread(s): " + " ".join(f"{x:.3f}" for x in t) + f" s, median {statistics.median(t):.3f} s"
        )
    one, many = times[1], times[max_threads]
    print(
        f"speedup at {max_threads} threads: {statistics.median(one) / statistics.median(many):.2f}x of the medians, "
        f"{statistics.median(a / b for a, b in zip(one, many, strict=True)):.2f}x median of the rounds"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
