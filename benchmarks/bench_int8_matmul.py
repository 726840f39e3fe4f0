"""fp32 matmul next to the int8 weight paths, at SmolLM2-135M's projection shapes, on CPU.

    python benchmarks/bench_int8_matmul.py [--repeats 7] [--threads N] [--rows 1,64] [--hot]

Paths, all ``x [M, K] fp32`` against a ``[N, K]`` weight, output fp32:

- ``fp32``: ``F.linear`` on the fp32 weight (what the model does without quantization).
- ``pack32``: ``aten._weight_int8pack_mm(x, w_int8, scales)`` on fp32 ``x``: weight-only, exact fp32
  activations. In torch 2.13 only the bf16 instantiation of this CPU kernel is vectorized; fp32 and fp16
  run a scalar loop (skipped above ``M = 8``, where one call takes seconds).
- ``pack16``: the same kernel on ``x`` cast to bf16 (scales in bf16), the output cast back to fp32.
- ``int_mm``: ``torch._int_mm`` on per-row dynamically quantized activations, int32 accumulate, then both
  scales; the time includes quantizing ``x``.
- ``dequant``: cast the int8 weight to fp32, matmul, scale the columns (the portable fallback).

Each time is the median over ``--repeats`` rounds of a timed loop (the machine is shared and noisy); the
paths alternate inside each round so drift hits them alike. Each path cycles through copies of its weight
adding up to 256 MB of fp32, so every call reads its weight from DRAM as in a decode step (``--hot``: one
copy, cache-warm). Also printed: the GB/s the fp32 and pack16
paths reach reading their weights (4 and 1 bytes per weight), and each int8 path's max abs error against
an fp32 matmul on the dequantized weight (the weight's own quantization error is common to all of them and
not part of this number).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# The engine's OpenMP setting (tokenmill/__init__.py), in place before torch loads so the times match it.
importlib.import_module("tokenmill")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tokenmill.model.quant import quantize_per_channel  # noqa: E402

# (name, N, K): qkv_proj, o_proj, gate_up_proj, down_proj, lm_head.
SHAPES = [
    ("qkv", 960, 576),
    ("o", 576, 576),
    ("gate_up", 3072, 576),
    ("down", 576, 1536),
    ("lm_head", 49152, 576),
]
INT8_PATHS = ("pack32", "pack16", "int_mm", "dequant")
NUM_LAYERS = 30  # the four projections repeat per layer, the head runs once per forward
COLD_BYTES = 256 * 2**20  # fp32 weight copies cycled per shape: well past the last-level cache


def int_mm_dynamic(x: torch.Tensor, w_int8_t: torch.Tensor, w_scales: torch.Tensor) -> torch.Tensor:
    """Per-row symmetric int8 activations through ``torch._int_mm``; ``w_int8_t`` is ``[K, N]``."""
    x_scales = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12) / 127  # [M, 1]
    xq = torch.round(x / x_scales).clamp_(-127, 127).to(torch.int8)  # [M, K]
    return torch._int_mm(xq, w_int8_t).float() * x_scales * w_scales  # [M, N]


def time_ms(fn: Callable[[int], torch.Tensor], num_copies: int, min_time_s: float = 0.05) -> float:
    """ms per call of ``fn(copy index)`` over a loop of at least ``min_time_s``, cycling the copies."""
    for i in range(num_copies):  # touch every copy once
        fn(i)
    n, elapsed = num_copies, 0.0
    while True:
        t0 = time.perf_counter()
        for i in range(n):
            fn(i % num_copies)
        elapsed = time.perf_counter() - t0
        if elapsed >= min_time_s:
            return elapsed / n * 1e3
        n *= 2


def bench_shape(n: int, k: int, m: int, repeats: int, cold_bytes: int) -> dict[str, float]:
    """ms per call of every path (nan where skipped), and ``<path>_err`` max abs errors.

    Each path cycles through copies of its weight adding up to at least ``cold_bytes`` of fp32, so a call
    reads its weight from memory the way a decode step does (the model's 540 MB do not fit in cache),
    not from a cache the previous call warmed.
    """
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.05
    x = torch.randn(m, k)
    w_int8, scales = quantize_per_channel(w, torch.bfloat16)
    scales = scales.float()  # on the bf16 grid, as Int8Linear keeps them
    scales_bf16 = scales.to(torch.bfloat16)
    num_copies = max(1, -(-cold_bytes // (n * k * 4)))
    w32 = [w.clone() for _ in range(num_copies)]
    w8 = [w_int8.clone() for _ in range(num_copies)]
    w8_t = [w_int8.t().contiguous() for _ in range(num_copies)]  # [K, N] for _int_mm
    paths: dict[str, Callable[[int], torch.Tensor]] = {
        "fp32": lambda i: F.linear(x, w32[i]),
        "pack32": lambda i: torch.ops.aten._weight_int8pack_mm(x, w8[i], scales),
        "pack16": lambda i: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), w8[i], scales_bf16).float(),
        "int_mm": lambda i: int_mm_dynamic(x, w8_t[i], scales),
        "dequant": lambda i: F.linear(x, w8[i].float()) * scales,
    }
    if m > 8:
        del paths["pack32"]
    reference = F.linear(x, w_int8.float() * scales[:, None])
    result: dict[str, float] = {f"{name}_err": float("nan") for name in INT8_PATHS}
    result |= {name: float("nan") for name in ("fp32", *INT8_PATHS)}
    for name in INT8_PATHS:
        if name in paths:
            result[f"{name}_err"] = (paths[name](0) - reference).abs().max().item()
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, fn in paths.items():
            samples[name].append(time_ms(fn, num_copies))
    result.update({name: statistics.median(times) for name, times in samples.items()})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rows", default="1,64", help="comma-separated M (tokens per matmul)")
    parser.add_argument(
        "--hot", action="store_true", help="reuse one weight per shape (cache-warm) instead of cycling copies"
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cache = "one weight per shape (cache-warm)" if args.hot else f"weights cycled over {COLD_BYTES >> 20} MB"
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats} rounds, {cache}"
    )
    times = "".join(f" {name:>8}" for name in ("fp32", *INT8_PATHS))
    errors = "".join(f" {name:>8}" for name in INT8_PATHS)
    header = (
        f"{'shape':<8} {'N x K':>12} {'M':>3} |{times} | {'fp32/p16':>8} |"
        f" {'GB/s f32':>8} {'p16':>6} | max abs err:{errors}"
    )
    print(f"{'':<26}|{'ms per call':^{len(times)}}")
    print(header)
    print("-" * len(header))
    totals: dict[int, dict[str, float]] = {}
    for m in (int(r) for r in args.rows.split(",")):
        total = totals.setdefault(m, dict.fromkeys(("fp32", *INT8_PATHS), 0.0))
        for name, n, k in SHAPES:
            r = bench_shape(n, k, m, args.repeats, cold_bytes=0 if args.hot else COLD_BYTES)
            for path in total:
                total[path] += r[path] * (1 if name == "lm_head" else NUM_LAYERS)
            fp32_gbs = n * k * 4 / (r["fp32"] * 1e-3) / 1e9
            pack16_gbs = n * k * 1 / (r["pack16"] * 1e-3) / 1e9
            row_times = "".join(f" {r[path]:8.3f}" for path in ("fp32", *INT8_PATHS))
            row_errors = "".join(f" {r[f'{path}_err']:8.1e}" for path in INT8_PATHS)
            print(
                f"{name:<8} {f'{n} x {k}':>12} {m:>3} |{row_times} | {r['fp32'] / r['pack16']:7.2f}x |"
                f" {fp32_gbs:8.1f} {pack16_gbs:6.1f} | {'':11}{row_errors}"
            )
    print()
    print(f"one forward's matmuls ({NUM_LAYERS} layers x [qkv, o, gate_up, down] + lm_head), ms:")
    for m, total in totals.items():
        print(f"  M={m:<3} " + ", ".join(f"{path} {ms:.2f}" for path, ms in total.items()))


if __name__ == "__main__":
    main()
