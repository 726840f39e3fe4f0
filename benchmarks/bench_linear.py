"""The C++ matmuls (``model/csrc/panel_linear.h``, ``small_linear.h``) next to the kernels they replace, on CPU.

    python benchmarks/bench_linear.py [--rows 1,2,4,8,16,64] [--layers 30] [--repeats 5] [--threads 2]
                                      [--variants avx512,avx2,base]

For each row count, the time of all projections of ``--layers`` layers of SmolLM2-135M (qkv, o, gate_up, down:
the weights of 30 layers are 420 MB of fp32, so every call reads its weight from memory as in a decode step):

- ``onednn``: fp32 through oneDNN with its packed weight (the model's path without the C++ kernels),
- ``panel-<variant>``: fp32 through ``panel_linear`` on column panels (the model's fp32 path), per kernel variant,
- ``small8-<variant>``: int8 weights through ``small_linear`` (int16 inputs; the model's int8 path), per variant,
- ``torch8``: int8 weights through ``aten._weight_int8pack_mm`` on bf16 inputs (torch's own int8 kernel),
- ``q4_1-<variant>``: the same weights as GGUF Q4_1 blocks kept quantized, through ``quant_linear``
  (``csrc/quant_linear.h``; the model's default path on a quantized GGUF), per variant.

Printed side by side in one run, with the GB/s each reaches on its weight bytes and the fp32 paths' GFLOP/s;
the best of ``--repeats`` rounds, the paths alternating inside each round so drift on this shared machine hits
them alike.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
importlib.import_module("tokenmill")  # its OpenMP setting must be in place before torch loads
import gguf  # noqa: E402
import torch  # noqa: E402

from tokenmill.model.cpu import variants as kernel_variants  # noqa: E402
from tokenmill.model.cpu.kernels import load_variant  # noqa: E402
from tokenmill.model.gguf_blocks import QuantizedWeight, to_groups  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K): qkv, o, gate_up, down


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,64")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    runnable = kernel_variants.runnable_variants(kernel_variants.read_cpu_info()[1])
    parser.add_argument(
        "--variants", default=",".join(runnable), help="kernel variants to time, side by side"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    modules = {v: load_variant(v) for v in args.variants.split(",") if v}
    if not modules:
        sys.exit("no kernel variant to time")
    gen = torch.Generator().manual_seed(0)
    fp32 = [[torch.randn(n, k, generator=gen) for n, k in SHAPES] for _ in range(args.layers)]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in layer] for layer in fp32]
    paneled = {v: [[mod.pack_panels(w) for w in layer] for layer in fp32] for v, mod in modules.items()}
    int8 = [
        [
            (torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen), torch.rand(n))
            for n, k in SHAPES
        ]
        for _ in range(args.layers)
    ]
    scales_bf16 = [[s.bfloat16() for _, s in layer] for layer in int8]
    q4 = {
        v: [[_q4_1(w, int(mod.quant_tile_rows())) for w in layer] for layer in fp32]
        for v, mod in modules.items()
    }
    q4_bytes = next(iter(q4.values()))[0][0].nbytes / (SHAPES[0][0] * SHAPES[0][1])
    num_weights = args.layers * sum(n * k for n, k in SHAPES)
    print(
        f"{args.layers} layers, {num_weights * 4 / 1e6:.0f} MB fp32 / {num_weights / 1e6:.0f} MB int8, {args.threads} threads"
    )
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen) for _, k in SHAPES}
        xb = {k: x.bfloat16() for k, x in xs.items()}
        paths: dict[str, tuple[Callable[[int, int], object], float]] = {
            "onednn": (
                lambda i, j, xs=xs: torch.ops.mkldnn._linear_pointwise(
                    xs[SHAPES[j][1]], packed[i][j], None, "none", [], ""
                ),
                4,
            ),
            **{
                f"panel-{v}": (
                    lambda i, j, xs=xs, mod=mod, v=v: mod.panel_linear(
                        xs[SHAPES[j][1]], paneled[v][i][j], SHAPES[j][0]
                    ),
                    4,
                )
                for v, mod in modules.items()
            },
            **{
                f"small8-{v}": (
                    lambda i, j, xs=xs, mod=mod: mod.small_linear(xs[SHAPES[j][1]], *int8[i][j]),
                    1,
                )
                for v, mod in modules.items()
            },
            "torch8": (
                lambda i, j, xb=xb: torch.ops.aten._weight_int8pack_mm(
                    xb[SHAPES[j][1]], int8[i][j][0], scales_bf16[i][j]
                ),
                1,
            ),
            **{
                f"q4_1-{v}": (
                    lambda i, j, xs=xs, mod=mod, v=v: mod.quant_linear(
                        xs[SHAPES[j][1]], q4[v][i][j].data, q4[v][i][j].meta
                    ),
                    q4_bytes,
                )
                for v, mod in modules.items()
            },
        }
        best = dict.fromkeys(paths, float("inf"))
        with torch.inference_mode():
            for _ in range(args.repeats):
                for name, (fn, _) in paths.items():
                    t0 = time.perf_counter()
                    for i in range(args.layers):
                        for j in range(len(SHAPES)):
                            fn(i, j)
                    best[name] = min(best[name], time.perf_counter() - t0)
        cells = [
            f"{name} {best[name] * 1e3:7.2f} ms ({num_weights * width / best[name] / 1e9:4.1f} GB/s"
            + (f", {2 * m * num_weights / best[name] / 1e9:3.0f} GFLOP/s)" if width != 1 else ")")
            for name, (_, width) in paths.items()
        ]
        print(f"rows {m:4d}:\n    " + "\n    ".join(cells))


def _q4_1(weight: torch.Tensor, tile_rows: int) -> QuantizedWeight:
    """``weight`` as GGUF Q4_1 (the gguf package's quantizer), rewritten as the model keeps it."""
    raw = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q4_1)
    return QuantizedWeight.from_groups([to_groups("Q4_1", raw, weight.shape[1])], tile_rows)


if __name__ == "__main__":
    main()
