"""The kernels' outputs do not depend on how many threads computed them.

A prefill's matmuls and attention go in units of work taken by whichever thread comes free first
(``csrc/work_units.h``), so which thread computes an output changes from run to run; each output is still one
unit's, computed in one order. So: the same bits at 1, 2 and 3 threads (3 on these 2 cores: the threads take turns
and the units fall differently again), on row counts below and above the rows a decode step splits statically,
through the 8-bit path, the exact path's three routes (tiles expanded once, tile by tile, a wide K in pieces), the
fp32 panels and the prefill attention.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from test_attention import _prefill_case
from test_quant_kernel_rows import _weights

THREAD_COUNTS = (1, 2, 3)
ROW_COUNTS = (1, 20, 33, 300)


@pytest.fixture
def threads() -> Iterator[Callable[[int], None]]:
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _same_at_every_count(
    set_threads: Callable[[int], None], compute: Callable[..., torch.Tensor], *args, **kwargs
):
    outputs = []
    for n in THREAD_COUNTS:
        set_threads(n)
        outputs.append(compute(*args, **kwargs))
    for n, out in zip(THREAD_COUNTS[1:], outputs[1:]):
        assert torch.equal(out, outputs[0]), f"{n} threads differ from 1"


@pytest.mark.parametrize(
    ("types", "q8", "in_features"),
    [
        (("Q4_K", "Q6_K"), True, 1024),  # the 8-bit path, a K-quant and a byte-quad part
        (("Q4_K", "Q6_K"), False, 1024),  # the exact path: tiles expanded once, or tile by tile
        (("Q4_K",), False, 8960),  # a wide K in pieces
    ],
)
def test_quantized_matmul(kernel_variant, threads, types, q8: bool, in_features: int) -> None:
    weight, _ = _weights(types, 96, in_features, kernel_variant.quant_tile_rows(), q8=q8)
    x = torch.randn(max(ROW_COUNTS), in_features, generator=torch.Generator().manual_seed(3))
    for m in ROW_COUNTS:
        for expand_once_bytes in (-1, 0):
            _same_at_every_count(
                threads,
                kernel_variant.quant_linear,
                x[:m],
                weight.data,
                weight.meta,
                expand_once_bytes=expand_once_bytes,
            )


def test_fp32_panels(kernel_variant, threads) -> None:
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(200, 512, generator=gen)
    panels = kernel_variant.pack_panels(w)
    x = torch.randn(max(ROW_COUNTS), 512, generator=gen)
    for m in ROW_COUNTS:
        _same_at_every_count(threads, kernel_variant.panel_linear, x[:m], panels, w.shape[0])


def test_prefill_attention(kernel_variant, threads) -> None:
    case = _prefill_case(12, 2, 128, 16, torch.float32)  # the 1.5B's heads

    def run() -> torch.Tensor:
        out = torch.zeros_like(case.q)
        kernel_variant.paged_prefill_(
            out, case.q, case.k_cache, case.v_cache, case.tables, case.rows, 1 / 128**0.5
        )
        return out

    _same_at_every_count(threads, run)
