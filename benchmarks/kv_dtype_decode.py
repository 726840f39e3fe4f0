"""Single-stream decode at depth, per KV cache dtype, side by side in one run.

    python -m benchmarks.kv_dtype_decode [--model NAME] [--depths 1024,8192,16384]
        [--dtypes float32,float16,bfloat16,float8_e4m3fn,int8]

A decode step at a context of N tokens reads the weights and N tokens of K and V in every layer (the 1.5B: 28
layers x 2 KV heads x 128 x 2, 57 KB a token in fp32, 29 KB in 16 bits, 14 KB in fp8, 15 KB in int8 with its
scales). To time the step at depth without
computing an N-token prefill per row, the model's KV tensors are filled with random values (their contents do
not change the work) and the model's own forward runs one token after an N-token context through a shuffled block
table, as the engine's runner calls it (the C++ decode stack on CPU), ``--steps`` times after a warm-up; the
median step is printed as tokens/s with the KV bytes it read. The weights: the default arithmetic.

With ``--llama-server PATH`` (the prebuilt one of ``../shared/PEERS.md``) llama.cpp's server runs the same GGUF
after tokenmill, one slot with a context of the deepest depth, as its user gets it (f16 KV): per depth a prompt
of that many tokens of Python source, then ``--llama-tokens`` decoded tokens, its own ``predicted_per_second``; the
last column is tokenmill's default KV dtype over it.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

from benchmarks.common import cpu_name


def step_times(model, depth: int, dtype: torch.dtype, steps: int, block_size: int = 16) -> list[float]:
    from tokenmill.model import kv_format
    from tokenmill.model.loader import allocate_kv_cache

    config = model.config
    num_blocks = -(-(depth + 1) // block_size)
    caches = allocate_kv_cache(config, num_blocks + 1, block_size, dtype, "cpu")
    gen = torch.Generator().manual_seed(depth)
    shape = (num_blocks + 1, block_size, config.num_key_value_heads, config.head_dim)
    for k, v in caches:
        k.copy_(kv_format.encode(torch.randn(shape, generator=gen), dtype))
        v.copy_(kv_format.encode(torch.randn(shape, generator=gen), dtype))
    table = list(range(1, num_blocks + 1))
    random.Random(depth).shuffle(table)
    times = []
    with torch.inference_mode():
        for i in range(steps + 2):
            meta = model.plan_attention([1], [depth + 1], [table], block_size)
            t0 = time.perf_counter()
            hidden = model(torch.tensor([i % config.vocab_size]), torch.tensor([depth]), meta, caches)
            model.compute_logits(hidden)
            times.append(time.perf_counter() - t0)
    return times[2:]


def code_tokens(gguf: str, num_tokens: int) -> list[int]:
    """The first ``num_tokens`` tokens of Python's standard library source: a prompt the model continues as code
    (random ids lead llama-server's output parser to refuse what the model writes after them)."""
    import argparse as m1
    import collections as m2
    import dataclasses as m3
    import email.message as m4
    import inspect
    import pathlib as m5
    import textwrap as m6
    import typing as m7

    from tokenmill.tokenizer import Tokenizer

    text = "\n".join(inspect.getsource(m) for m in (m1, m2, m3, m4, m5, m6, m7))
    ids = list(Tokenizer.from_gguf(gguf).encode(text))
    if len(ids) < num_tokens:
        raise ValueError(f"the source text holds {len(ids)} tokens, fewer than {num_tokens}")
    return ids[:num_tokens]


def llama_server_rates(binary: str, gguf: str, depths: list[int], num_tokens: int) -> dict[int, float]:
    """llama-server's decode rate after a prompt of each depth (one slot, context for the deepest)."""
    from benchmarks.common import llama_server, post_json

    out = {}
    with llama_server(binary, gguf, "-np", "1", "-c", str(max(depths) + num_tokens + 64)) as url:
        body = {"n_predict": 4, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
        post_json(url + "/completion", {**body, "prompt": code_tokens(gguf, 16)})
        for depth in depths:
            reply = post_json(
                url + "/completion", {**body, "prompt": code_tokens(gguf, depth), "n_predict": num_tokens}
            )
            assert reply["tokens_predicted"] == num_tokens, reply["tokens_predicted"]
            out[depth] = float(reply["timings"]["predicted_per_second"])
            print(f"  llama-server at {depth}: prefill {reply['timings']['prompt_per_second']:.1f} tok/s, "
                  f"decode {out[depth]:.2f} tok/s", flush=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--depths", default="1024,8192,16384")
    parser.add_argument("--dtypes", default="float32,float16,bfloat16,float8_e4m3fn,int8")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--llama-server", default=None, help="path to llama-server (omit: tokenmill only)")
    parser.add_argument("--llama-tokens", type=int, default=32, help="tokens llama-server decodes per depth")
    args = parser.parse_args(argv)
    from tokenmill.model.loader import kv_bytes_per_block, load_model
    from tokenmill.model.registry import resolve

    loaded = load_model(resolve(args.model), device="cpu")
    config = loaded.config
    print(f"{cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads; {args.model}, "
          f"{loaded.describe_arithmetic().split(':')[0]}; median of {args.steps} steps")  # fmt: skip
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    depths = [int(d) for d in args.depths.split(",")]
    rates: dict[int, list[float]] = {}
    print(f"{'context':>8} " + " ".join(f"{str(d).removeprefix('torch.'):>22}" for d in dtypes))
    for depth in depths:
        cells = []
        for dtype in dtypes:
            step_s = statistics.median(step_times(loaded.model, depth, dtype, args.steps))
            rates.setdefault(depth, []).append(1 / step_s)
            kv_mb = kv_bytes_per_block(config, 1, dtype) * depth / 1e6
            cells.append(f"{1 / step_s:7.2f} tok/s ({kv_mb:6.0f} MB)")
        print(f"{depth:>8} " + " ".join(f"{c:>22}" for c in cells), flush=True)
    if args.llama_server:
        default = torch.float16 if torch.float16 in dtypes else dtypes[0]
        peer = llama_server_rates(args.llama_server, loaded.source, depths, args.llama_tokens)
        print(
            f"llama-server (f16 KV, {args.llama_tokens} tokens after the prompt) beside tokenmill's {default}:"
        )
        for depth in depths:
            ours = rates[depth][dtypes.index(default)]
            print(
                f"{depth:>8} llama-server {peer[depth]:7.2f} tok/s  tokenmill {ours:7.2f}  {ours / peer[depth]:5.2f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
