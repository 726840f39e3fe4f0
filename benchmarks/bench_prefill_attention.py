"""The C++ prefill attention (``model/csrc/attention_prefill.h``) per kernel variant, against torch's SDPA.

    python benchmarks/bench_prefill_attention.py [--tokens 1024] [--prefix 0] [--variants avx512,avx2] [--repeats 10]

One sequence of ``--tokens`` prompt tokens (after ``--prefix`` tokens already in the cache: a later chunk of a
long prompt, or a prompt after a cached prefix) with SmolLM2-135M's heads (9 query / 3 KV, D = 64) in a paged cache
of shuffled 16-token blocks: the time of one layer's causal attention (best of ``--repeats`` rounds, the variants alternating within each), times 30 layers,
the GFLOP/s on the causal FLOPs (4 x T x (prefix + T / 2) x D x query heads), and the largest difference from
``F.scaled_dot_product_attention`` on the same tensors (the check that the timed kernel is the right one).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
importlib.import_module("tokenmill")  # its OpenMP setting must be in place before torch loads
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tokenmill.model.cpu import variants as kernel_variants  # noqa: E402
from tokenmill.model.cpu.kernels import load_variant  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_LAYERS = 9, 3, 64, 16, 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--prefix", type=int, default=0, help="tokens already in the cache before them")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    runnable = kernel_variants.runnable_variants(kernel_variants.read_cpu_info()[1])
    parser.add_argument("--variants", default=",".join(v for v in runnable if v != "base"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    T, P, group = args.tokens, args.prefix, NUM_HEADS // NUM_KV_HEADS
    num_keys = P + T
    num_blocks = -(-num_keys // BLOCK_SIZE)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(T, NUM_HEADS, HEAD_DIM, generator=gen)  # [T, Hq, D]
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    block_table = torch.randperm(num_blocks, generator=gen).view(1, num_blocks)
    seqs = torch.tensor([[0, T, P, 0]])  # (first row, query tokens, first position, block table row)
    scale = HEAD_DIM**-0.5

    def gathered(
        cache: torch.Tensor,
    ) -> torch.Tensor:  # the sequence's keys or values in order, [Hq, P + T, D]
        flat = cache[block_table[0]].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:num_keys]
        return flat.repeat_interleave(group, 1).transpose(0, 1)

    # query i (position P + i) sees keys 0..P + i
    mask = torch.arange(num_keys)[None, :] <= (P + torch.arange(T))[:, None]  # [T, P + T]
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1), gathered(k_cache), gathered(v_cache), attn_mask=mask, scale=scale
    ).transpose(0, 1)
    flops = 4 * T * (P + T / 2) * HEAD_DIM * NUM_HEADS
    print(f"{T} tokens after {P}, {NUM_HEADS}/{NUM_KV_HEADS} heads, D={HEAD_DIM}, {args.threads} threads")
    modules = {name: load_variant(name) for name in args.variants.split(",") if name}
    outs = {name: torch.zeros_like(q) for name in modules}
    best = dict.fromkeys(modules, float("inf"))
    for round_index in range(args.repeats + 1):  # the variants alternate within a round; round 0 warms up
        for name, mod in modules.items():
            t0 = time.perf_counter()
            mod.paged_prefill_(outs[name], q, k_cache, v_cache, block_table, seqs, scale)
            if round_index > 0:
                best[name] = min(best[name], time.perf_counter() - t0)
    for name in modules:
        err = (outs[name] - ref).abs().max().item()
        print(
            f"  {name:<7} {best[name] * 1e3:6.2f} ms/layer, x{NUM_LAYERS} = {best[name] * NUM_LAYERS * 1e3:5.0f} ms, "
            f"{flops / best[name] / 1e9:5.0f} GFLOP/s, max |diff| from SDPA {err:.1e}"
        )


if __name__ == "__main__":
    main()
