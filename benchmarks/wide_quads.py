"""A Q8_0 matrix on the exact path and as wide byte quads (8-bit activations), per kernel variant, on CPU.

    python -m benchmarks.wide_quads [--rows 1,16,512] [--repeats 7] [--copies 4] [--variants avx512,avx2]

The weights: the ``gguf`` package's Q8_0 quantization of Gaussian values at Qwen2.5-Coder-1.5B's gate/up
(17,920 x 1,536) and down (1,536 x 8,960) shapes, kept as blocks twice: ``exact`` (fp32 activations times the
blocks' values, ``--quantization gguf``) and ``wide`` (activations rounded to 8 bits per 32, integer dot products
with the codes, ``gguf-q8``), ``--copies`` times over so that each call reads its weight from memory as a decode
step does (4 copies: 117 MB of the gate/up's). Printed: GOP/s of each (2 M N K over the best of ``--repeats``
rounds of a call per copy, the two alternating so drift hits them alike) and their ratio.
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
import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from tokenmill.model.cpu import variants as kernel_variants  # noqa: E402
from tokenmill.model.cpu.kernels import load_variant  # noqa: E402
from tokenmill.model.gguf_blocks import QuantizedWeight, to_groups  # noqa: E402

SHAPES = [(17920, 1536), (1536, 8960)]  # (N, K): the 1.5B's gate/up and down projections


def q8_0_weights(n: int, k: int, tile_rows: int) -> dict[str, QuantizedWeight]:
    values = np.random.default_rng(0).standard_normal((n, k), dtype=np.float32) * 0.02
    raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
    groups = to_groups("Q8_0", raw, k)
    return {
        "exact": QuantizedWeight.from_groups([groups], tile_rows),
        "wide": QuantizedWeight.from_groups([groups], tile_rows, int8_activations=True),
    }


def best_times(
    module, copies: list[dict[str, QuantizedWeight]], x: torch.Tensor, repeats: int
) -> dict[str, float]:
    """The best time of one call, each round a call on every copy, per form."""
    best = {name: float("inf") for name in copies[0]}
    for _ in range(repeats):
        for name in best:
            start = time.perf_counter()
            for weights in copies:
                module.quant_linear(x, weights[name].data, weights[name].meta)
            best[name] = min(best[name], (time.perf_counter() - start) / len(copies))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,512")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--copies", type=int, default=4, help="copies of each weight, read in turn")
    parser.add_argument(
        "--variants", default=None, help="comma-separated; default: those this CPU runs but base"
    )
    args = parser.parse_args()
    cpu, flags = kernel_variants.read_cpu_info()
    names = args.variants.split(",") if args.variants else kernel_variants.runnable_variants(flags)[:-1]
    print(
        f"# {cpu}; {torch.get_num_threads()} threads; Q8_0 blocks, GOP/s (2 M N K / time), best of {args.repeats}"
    )
    for variant in names:
        module = load_variant(variant, flags)
        for n, k in SHAPES:
            copies = [q8_0_weights(n, k, int(module.quant_tile_rows())) for _ in range(args.copies)]
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                best = best_times(module, copies, x, args.repeats)
                rate = {name: 2 * m * n * k / t / 1e9 for name, t in best.items()}
                print(
                    f"{variant:6s} {n:5d}x{k:<5d} rows {m:4d}: exact {rate['exact']:6.1f}, wide {rate['wide']:6.1f}"
                    f" ({rate['wide'] / rate['exact']:.2f}x)"
                )


if __name__ == "__main__":
    main()
