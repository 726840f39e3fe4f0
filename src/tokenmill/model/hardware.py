"""The machine's limits, measured: matmul throughput at the model's shapes and memory read bandwidth.

Both are "the best this process showed", so a case's lower bound (``cost_model``) is one the same
threads and dtype could in principle reach:

- ``peak_flops``: the fp32 limit. On CPU, the FLOP/s of the kernels' multiply-add (``vfmadd`` on 8 or 16 lanes)
  in a loop that keeps its operands in registers; torch's own matmuls are no limit there (on Zen 5, family
  26, they reach about half of it, where the exact path's kernels reach more). Elsewhere, or without the C++
  kernels, the best of ``matmul``. Never below the best matmul.
- ``matmul``: the FLOP/s of ``F.linear(x [M, K], w [N, K])`` over the model's projection shapes (q/k/v/o,
  gate/up/down, and their fused forms) at a compute-bound number of tokens: what torch itself reaches.
- ``peak_int_ops``: on CPU, the integer operations per second of the dot product the 8-bit-activation
  kernels use (``vpdpbusd``, or ``vpmaddubsw`` + ``vpmaddwd`` on AVX2) in a loop that keeps its operands in
  registers: the limit of ``gguf-q8``'s matmuls, as ``peak_flops`` is of fp32 ones.
- ``peak_read_bw``: the best bytes/s of two read-only kernels over a tensor far larger than the
  last-level cache: ``x.sum()`` and a matrix-vector product (what a decode step does to its weights).
  On CPU the tensor is twice the last-level cache as Linux reports it, and at least 256 MiB: some cloud
  CPUs report a 480 MiB L3, where 256 MiB read partly from that cache and measured 34-43 GB/s against
  30-33 GB/s from memory (2 threads, Xeon under KVM, 2026-12-01).

Run alone: ``python -m tokenmill.model.hardware [--device cuda]``. The suite measures with it
(``benchmarks/suite.py``), and so does the engine at start with ``--hardware-limits measure`` (its per-step
roofline fraction, ``tokenmill.measure.roofline``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class MatmulPoint:
    name: str
    num_tokens: int  # M
    in_features: int  # K
    out_features: int  # N
    gflops: float  # achieved, 2*M*K*N / best time


@dataclass(frozen=True)
class HardwareLimits:
    device: str
    dtype: str
    num_threads: int
    peak_flops: float  # FLOP/s: the register-resident multiply-add on CPU, else the best matmul
    peak_read_bw: float  # bytes/s
    matmul: list[MatmulPoint] = field(default_factory=list)
    bandwidth_by_method: dict[str, float] = field(default_factory=dict)  # bytes/s
    bandwidth_probe_bytes: int = 0  # the size of the tensor read
    last_level_cache_bytes: int | None = None  # CPU only, as Linux reports it
    # the 8-bit-activation kernels' integer dot product in registers (ops/s, 2 per multiply-add); None unmeasured
    peak_int_ops: float | None = None
    int_instruction: str = ""
    peak_fma_flops: float | None = None  # the fp32 multiply-add in registers (FLOP/s); None unmeasured
    # of a dot product's issue slot, what an fp32 multiply-add beside the dot products takes (1: the same ports, 0:
    # ports of its own): what the 8-bit kernels' epilogue costs them; None unmeasured
    fma_dot_share: float | None = None

    @property
    def peak_matmul_flops(self) -> float:
        """The best FLOP/s torch's own matmul reached (0 where none ran)."""
        return max((p.gflops for p in self.matmul), default=0.0) * 1e9

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def describe(self) -> str:
        lines = [
            f"hardware limits on {self.device} ({self.dtype}, {self.num_threads} threads): "
            f"compute {self.peak_flops / 1e9:.1f} GFLOP/s, read bandwidth {self.peak_read_bw / 1e9:.1f} GB/s",
        ]
        if self.peak_fma_flops:
            lines.append(
                f"  fp32 multiply-add in registers {self.peak_fma_flops / 1e9:.1f} GFLOP/s; torch's best matmul "
                f"{self.peak_matmul_flops / 1e9:.1f} ({self.peak_matmul_flops / self.peak_fma_flops:.0%} of it)"
            )
        if self.peak_int_ops:
            share = (
                ""
                if self.fma_dot_share is None
                else (f"; a multiply-add beside it takes {self.fma_dot_share:.2f} of its issue slot")
            )
            lines.append(
                f"  integer dot product ({self.int_instruction}) {self.peak_int_ops / 1e9:.1f} GOP/s{share}"
            )
        for p in self.matmul:
            lines.append(
                f"  matmul {p.name:<10} [{p.num_tokens}x{p.in_features}]x[{p.in_features}x{p.out_features}]"
                f"  {p.gflops:8.1f} GFLOP/s"
            )
        probe = f"{self.bandwidth_probe_bytes >> 20} MiB read"
        if self.last_level_cache_bytes:
            probe += f", last-level cache {self.last_level_cache_bytes >> 20} MiB"
        for name, bw in self.bandwidth_by_method.items():
            lines.append(f"  read   {name:<10} {bw / 1e9:8.1f} GB/s  ({probe})")
        return "\n".join(lines)


def model_matmul_shapes(
    hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int, vocab_size: int
) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of a decoder layer's projections (unfused and fused) and the LM head."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    return [
        ("q/o", hidden, q),
        ("k/v", hidden, kv),
        ("qkv", hidden, q + 2 * kv),
        ("gate/up", hidden, intermediate),
        ("gate_up", hidden, 2 * intermediate),
        ("down", intermediate, hidden),
        ("lm_head", hidden, vocab_size),
    ]


def best_time_s(
    fn: Callable[[], object], sync: Callable[[], None], min_total_s: float = 0.25, min_reps: int = 3
) -> float:
    """Best wall time of one call to ``fn`` (after one warm-up call), over at least ``min_reps`` calls."""
    fn()
    sync()
    best = float("inf")
    total = 0.0
    reps = 0
    while reps < min_reps or total < min_total_s:
        t0 = time.perf_counter()
        fn()
        sync()
        dt = time.perf_counter() - t0
        best = min(best, dt)
        total += dt
        reps += 1
    return best


def _sync_for(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def measure_matmul(
    shapes: list[tuple[str, int, int]],
    device: torch.device,
    dtype: torch.dtype,
    num_tokens: int = 1024,
    min_total_s: float = 0.25,
) -> list[MatmulPoint]:
    sync = _sync_for(device)
    points = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for name, k, n in shapes:
        x = torch.randn(num_tokens, k, generator=gen).to(device=device, dtype=dtype)  # [M, K]
        w = torch.randn(n, k, generator=gen).to(device=device, dtype=dtype)  # [N, K]
        with torch.inference_mode():
            t = best_time_s(lambda x=x, w=w: F.linear(x, w), sync, min_total_s)
        points.append(MatmulPoint(name, num_tokens, k, n, 2.0 * num_tokens * k * n / t / 1e9))
    return points


def last_level_cache_bytes(cpu_cache_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """The largest data or unified cache CPU 0 sees (Linux sysfs), or None where it is not reported."""
    sizes = []
    for index in sorted(cpu_cache_dir.glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if kind == "Instruction" or not size:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size))
    return max(sizes) if sizes else None


def bandwidth_probe_bytes(device: torch.device, llc_bytes: int | None) -> int:
    """How much to read for the bandwidth probe: 2 GiB on GPU; on CPU 2x the last-level cache, 256 MiB-4 GiB."""
    if device.type == "cuda":
        return 2 << 30
    return min(4 << 30, max(256 << 20, 2 * (llc_bytes or 0)))


def measure_read_bandwidth(
    device: torch.device, dtype: torch.dtype, num_bytes: int, min_total_s: float = 0.5
) -> dict[str, float]:
    """Bytes/s of read-only kernels over ``num_bytes`` of ``dtype`` (choose it well above the LLC size)."""
    sync = _sync_for(device)
    elem = torch.empty((), dtype=dtype).element_size()
    cols = 4096
    rows = max(1, num_bytes // (elem * cols))
    w = torch.ones(rows, cols, device=device, dtype=dtype)  # [R, C]
    v = torch.ones(cols, device=device, dtype=dtype)  # [C]
    nbytes = w.numel() * elem
    out: dict[str, float] = {}
    with torch.inference_mode():
        out["sum"] = nbytes / best_time_s(lambda: w.sum(), sync, min_total_s)
        out["gemv"] = nbytes / best_time_s(lambda: torch.mv(w, v), sync, min_total_s)
    return out


def _register_loop_rate(probe: str, ops_per_iter: str, min_total_s: float) -> float | None:
    """Operations per second of one of ``csrc/peak_probe.h``'s register-resident loops (the kernel module's
    function ``probe``, each round ``ops_per_iter()`` operations) on every torch thread; None without the kernels."""
    from tokenmill.model.cpu.kernels import loaded

    module = loaded().module
    if module is None:
        return None
    num_threads = torch.get_num_threads()
    iters = 1 << 18
    ops = getattr(module, ops_per_iter)() * iters * num_threads
    run = getattr(module, probe)
    return ops / best_time_s(lambda: run(iters, num_threads), lambda: None, min_total_s)


def measure_integer_peak(min_total_s: float = 0.3) -> tuple[float, str] | None:
    """(ops/s, instruction) of the 8-bit-activation kernels' integer dot product, its operands in registers."""
    from tokenmill.model.cpu.kernels import integer_dot_instruction

    rate = _register_loop_rate("qdot_peak", "qdot_peak_ops_per_iter", min_total_s)
    return None if rate is None else (rate, integer_dot_instruction())


def measure_fma_peak(min_total_s: float = 0.3) -> float | None:
    """FLOP/s of the fp32 kernels' multiply-add, its operands in registers; None without the C++ kernels."""
    return _register_loop_rate("fma_peak", "fma_peak_flops_per_iter", min_total_s)


def measure_fma_dot_share(min_total_s: float = 0.3) -> float | None:
    """Of a dot product's issue slot, the share an fp32 multiply-add beside the dot products takes: rounds of D dot
    products with F multiply-adds on chains of their own, timed against the same rounds without them (``csrc/
    peak_probe.h``'s ``dot_fma_mix``), (time with / time without - 1) x D / F, clipped to [0, 1]. None without the
    kernels, or where the dot product is not one instruction (AVX2, base)."""
    from tokenmill.model.cpu.kernels import loaded

    module = loaded().module
    if module is None:
        return None
    num_dots, num_fmas = module.dot_fma_mix_counts()
    if num_fmas == 0:
        return None
    num_threads, iters = torch.get_num_threads(), 1 << 18
    times = [
        best_time_s(lambda w=w: module.dot_fma_mix(iters, num_threads, w), lambda: None, min_total_s)
        for w in (False, True)
    ]
    return min(1.0, max(0.0, (times[1] / times[0] - 1.0) * num_dots / num_fmas))


def measure(
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    shapes: list[tuple[str, int, int]] | None = None,
    token_counts: tuple[int, ...] | None = None,
    bandwidth_bytes: int | None = None,
    quick: bool = False,
) -> HardwareLimits:
    """Measure both limits with the current ``torch.get_num_threads()``.

    Layer matmuls run at each of ``token_counts`` (default 1024 and 4096; 1024 with ``quick``): the
    largest is what a big prefill chunk sees, where throughput is highest.
    """
    device = torch.device(device)
    if shapes is None:  # SmolLM2-135M's shapes
        shapes = model_matmul_shapes(576, 1536, 9, 3, 64, 49152)
    llc_bytes = last_level_cache_bytes() if device.type == "cpu" else None
    if bandwidth_bytes is None:
        bandwidth_bytes = bandwidth_probe_bytes(device, llc_bytes)
    min_total_s = 0.1 if quick else 0.3
    if token_counts is None:
        token_counts = (1024,) if quick else (1024, 4096)
    # The LM head only sees the rows that sample (at most a batch's worth), so it runs at 256 rows.
    layer_shapes = [sh for sh in shapes if sh[0] != "lm_head"]
    head_shapes = [sh for sh in shapes if sh[0] == "lm_head"]
    points = [p for m in token_counts for p in measure_matmul(layer_shapes, device, dtype, m, min_total_s)]
    points += measure_matmul(head_shapes, device, dtype, 256, min_total_s)
    bw = measure_read_bandwidth(device, dtype, bandwidth_bytes, min_total_s)
    integer = measure_integer_peak(min_total_s) if device.type == "cpu" else None
    fma = measure_fma_peak(min_total_s) if device.type == "cpu" and dtype == torch.float32 else None
    share = measure_fma_dot_share(min_total_s) if integer else None
    return HardwareLimits(
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        num_threads=torch.get_num_threads(),
        peak_flops=max([p.gflops * 1e9 for p in points] + [fma or 0.0]),
        peak_read_bw=max(bw.values()),
        matmul=points,
        bandwidth_by_method=bw,
        bandwidth_probe_bytes=bandwidth_bytes,
        last_level_cache_bytes=llc_bytes,
        peak_int_ops=integer[0] if integer else None,
        int_instruction=integer[1] if integer else "",
        peak_fma_flops=fma,
        fma_dot_share=share,
    )


def measure_model(shape: Any, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                  quick: bool = False) -> HardwareLimits:  # fmt: skip
    """:func:`measure` at a model's projection and LM-head shapes (``shape``: a ``cost_model.ModelShape``)."""
    shapes = model_matmul_shapes(
        shape.hidden_size, shape.intermediate_size, shape.num_heads, shape.num_kv_heads, shape.head_dim,
        shape.vocab_size,
    )  # fmt: skip
    return measure(device, dtype, shapes, quick=quick)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype_name = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    print(measure(args.device, getattr(torch, dtype_name), quick=args.quick).describe())


if __name__ == "__main__":
    main()
