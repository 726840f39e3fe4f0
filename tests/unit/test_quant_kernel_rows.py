"""Every row count 1..300 through the GGUF-block matmul, on every block format and kernel variant this CPU runs.

The kernel splits x into blocks of rows (how many depends on K), takes one of three paths per block (one row,
a few rows expanded in registers, a panel for many) and one of two per call (each thread's tiles expanded once,
or tile by tile when they would not fit its buffer). A block of one row needs the row's sums over each group,
and a tail block of one row after bigger ones once read sums that were never written (a segfault on
Qwen2.5-1.5B's down projection, K = 8960, at 9, 17, 25 ... rows). So: every row count from 1 to 300, both
per-call paths (``expand_once_bytes=0`` forces tile by tile), K chosen so the row blocks are small and end in a
one-row tail many times, against the ``gguf`` package's dequantize and a float64 matmul. The same sweep runs
under AddressSanitizer in ``test_kernels_asan.py`` (slow), where a read past a buffer is an error, not luck.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_gguf_blocks import act_group, assert_fp32_matmul, reference, round_activations, wide_groups_of_16
from tiny_models import random_blocks

from tokenmill.model.gguf_blocks import FORMATS, QuantizedWeight, to_groups

MAX_ROWS = 300
# K = 1,024 makes blocks of 256 KB of x where each thread's tiles are expanded once (64 rows on AVX-512, 60 on AVX2:
# a multiple of the register block) and of 1 MB tile by tile (256 rows, 252), so tails of one row at 65, 129, ...
# or 61, 121, ... and at 257 or 253; the 8-bit path's blocks (252 rows) at 253.
IN_FEATURES = 1024
# K = 5,632 in pieces: blocks of 256 rows on AVX-512, 126 on AVX2, 60 on base (the chunked path past kQFusedRows):
# every count to 69 (past a block of 60), then counts around later multiples of 60, 126 and 256
PIECES_ROWS = (
    *range(1, 70),
    *(m + d for m in (120, 126, 180, 252, 256) for d in (-1, 0, 1)),
    299,
    300,
)
# a case of the 1.5B's shape class: K = 8,960 gives blocks of 8 rows (the crash), at a few row counts; past
# kQFusedRows rows such a K goes in pieces (quant_linear_chunked: blocks of 256 rows on AVX-512, 126 on AVX2, 60 on
# base), so also blocks ending in tails of 1, 2 and 4 rows after them
WIDE_K_ROWS = (
    1,
    2,
    8,
    9,
    13,
    16,
    17,
    25,
    31,
    32,
    34,
    36,
    *(b + t for b in (60, 126, 256) for t in (0, 1, 2, 4)),
)


def _weights(
    type_names: tuple[str, ...],
    rows_each: int,
    in_features: int,
    tile_rows: int,
    q8: bool = False,
    exact_rows: int = 0,
):
    """The types' random blocks stacked (then ``exact_rows`` of :func:`wide_groups_of_16`) and their weights."""
    raws = [random_blocks(t, rows_each, in_features, seed=i + 7) for i, t in enumerate(type_names)]
    groups = [to_groups(t, r, in_features) for t, r in zip(type_names, raws)]
    weights = [reference(t, r, in_features) for t, r in zip(type_names, raws)]
    if exact_rows:
        extra = wide_groups_of_16(exact_rows, in_features, seed=5)
        groups.append(extra)
        values = extra.codes.view(np.int8).astype(np.float32) * extra.scale[..., None]
        weights.append(torch.from_numpy(values.reshape(exact_rows, in_features)))
    weight = QuantizedWeight.from_groups(groups, tile_rows, int8_activations=q8)
    w = torch.cat(weights)
    assert torch.equal(weight.dequantize(), w)
    return weight, w


def _sweep(kernel, weight, w, in_features: int, row_counts, expected_fn) -> None:
    x = torch.randn(max(row_counts), in_features, generator=torch.Generator().manual_seed(in_features))
    expected, scale = expected_fn(x, w)
    for expand_once_bytes in (-1, 0):
        for m in row_counts:
            out = kernel.quant_linear(x[:m], weight.data, weight.meta, expand_once_bytes=expand_once_bytes)
            assert out.shape == (m, w.shape[0])
            err = ((out.double() - expected[:m]).abs() / scale[:m]).max().item()
            assert err < 1e-5, (m, expand_once_bytes, err)


def _exact(x: torch.Tensor, w: torch.Tensor):
    return x.double() @ w.double().T, (x.double().abs() @ w.double().abs().T).clamp_min(1e-30)


def _rounded(x: torch.Tensor, w: torch.Tensor, group: int = 32):
    r = round_activations(x, group)
    return r @ w.double().T, (r.abs() @ w.double().abs().T).clamp_min(1e-30)


@pytest.mark.parametrize("type_name", sorted(FORMATS))
def test_every_row_count_of_every_format(kernel_variant, type_name: str) -> None:
    width = kernel_variant.quant_tile_rows()
    # one full tile and a partial one: the partial tile's store is masked
    weight, w = _weights((type_name,), width + 3, IN_FEATURES, width)
    _sweep(kernel_variant, weight, w, IN_FEATURES, range(1, MAX_ROWS + 1), _exact)


def test_every_row_count_of_fused_mixed_types(kernel_variant) -> None:
    """A Q4_K_M file's fused projections: Q4_K, Q6_K and Q8_0 parts side by side, parts not tile-aligned."""
    width = kernel_variant.quant_tile_rows()
    weight, w = _weights(("Q4_K", "Q6_K", "Q8_0"), width // 2 + 1, IN_FEATURES, width)
    _sweep(kernel_variant, weight, w, IN_FEATURES, range(1, MAX_ROWS + 1), _exact)


@pytest.mark.parametrize("byte_type", ["Q6_K", "Q5_0", "Q5_1", "Q5_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS"])
def test_every_row_count_of_the_8_bit_path(kernel_variant, byte_type: str) -> None:
    """gguf-q8: a Q4_K part in the quad layout, an 8-bit part in byte quads (wide ones for the IQ4 types) and a
    Q8_0 part in wide byte quads, all times the rounded activations, next to an exact part (8-bit groups of 16
    spanning -128..127, which no quad layout takes); parts not tile-aligned."""
    width = kernel_variant.quant_tile_rows()
    n = width // 2 + 3
    weight, w = _weights(("Q4_K", byte_type, "Q8_0"), n, IN_FEATURES, width, q8=True, exact_rows=n)
    bits = {"Q6_K": 6, "IQ4_NL": 8, "IQ4_XS": 8}.get(byte_type, 5)  # five bits a code where the codes fit
    group = FORMATS[byte_type].group
    assert weight.type_summary() == f"4bit/g32/x8+{bits}bit/g{group}/x8+8bit/g32/x8+8bit/g16"
    x = torch.randn(MAX_ROWS, IN_FEATURES, generator=torch.Generator().manual_seed(3))
    # each rounded part by its activations' rounding (a K-quant's per super-block), the last part exact
    expected = [
        _rounded(x, w[i * n : (i + 1) * n], act_group(t)) for i, t in enumerate(("Q4_K", byte_type, "Q8_0"))
    ]
    expected.append(_exact(x, w[3 * n :]))
    for m in range(1, MAX_ROWS + 1):
        out = kernel_variant.quant_linear(x[:m], weight.data, weight.meta).double()
        for i, (exp, sc) in enumerate(expected):
            assert ((out[:, i * n : (i + 1) * n] - exp[:m]).abs() / sc[:m]).max() < 1e-5, (m, i)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_wide_inputs_end_in_one_row_blocks(kernel_variant, type_name: str) -> None:
    """K = 8,960 (Qwen2.5-1.5B's down projection): blocks of 8 rows, so 9, 17, 25, 65 rows end in one row."""
    width = kernel_variant.quant_tile_rows()
    weight, w = _weights((type_name,), width + 1, 8960, width)
    _sweep(kernel_variant, weight, w, 8960, WIDE_K_ROWS, _exact)


def _in_pieces(kernel_variant, type_name: str, row_counts) -> None:
    width = kernel_variant.quant_tile_rows()
    weight, w = _weights((type_name,), width + 3, 5632, width)
    _sweep(kernel_variant, weight, w, 5632, row_counts, _exact)


@pytest.mark.parametrize("type_name", sorted(FORMATS))
def test_row_counts_of_every_format_in_pieces(kernel_variant, type_name: str) -> None:
    """K = 5,632 (TinyLlama's down projection): cut in pieces on every variant (AVX-512 past 4,096 inputs, AVX2 and
    base past 5,461), the last piece short; the row counts of PIECES_ROWS (every one of 1..300 in the slow sweep
    below, which the AddressSanitizer run takes too)."""
    _in_pieces(kernel_variant, type_name, PIECES_ROWS)


@pytest.mark.slow
@pytest.mark.parametrize("type_name", sorted(FORMATS))
def test_every_row_count_of_every_format_in_pieces(kernel_variant, type_name: str) -> None:
    """The same, every row count 1..300."""
    _in_pieces(kernel_variant, type_name, range(1, MAX_ROWS + 1))


def test_wide_inputs_in_pieces_equal_the_uncut_fp32_panels(kernel_variant) -> None:
    """A wide K cut in pieces (each tile's piece expanded, the sums continuing from the last piece's) gives the
    fp32 panel kernel's result over the dequantized weights bit for bit: the same multiply-adds in the same order.
    A fused matrix of three types (groups of 32 and of 16, parts not tile-aligned)."""
    width = kernel_variant.quant_tile_rows()
    weight, w = _weights(("Q4_K", "Q6_K", "Q8_0"), width + 3, 8960, width)
    panels = kernel_variant.pack_panels(w)
    x = torch.randn(120, 8960, generator=torch.Generator().manual_seed(11))
    # blocks of 256 / 126 / 60 rows (AVX-512 / AVX2 / base): 90 and 120 rows end in no tail small enough for fused_rows
    for m in (90, 120):
        out = kernel_variant.quant_linear(x[:m], weight.data, weight.meta)
        assert torch.equal(out, kernel_variant.panel_linear(x[:m], panels, w.shape[0])), m
    assert_fp32_matmul(out, x, w)


# the 8-bit path's row blocks (kQ8Rows: 6 on AVX-512, 4 on 256-bit variants) and its blocks of ~256 KB of codes
SILU_ROWS = (1, 2, 5, 7, 13, 64, 65, 253, 300)


def test_silu_made_as_the_8_bit_path_reads_it(kernel_variant) -> None:
    """quant_linear_silu(gate | up) is silu_mul then quant_linear, bit for bit, where every part takes 8-bit
    activations (the product made a span at a time, never stored): Q4_K, Q6_K and Q8_0 parts, each within the
    rounding of silu_mul's product by its own activations' rounding (a K-quant's per super-block)."""
    width = kernel_variant.quant_tile_rows()
    n = width // 2 + 3
    types = ("Q4_K", "Q6_K", "Q8_0")
    weight, w = _weights(types, n, IN_FEATURES, width, q8=True)
    gate_up = 3 * torch.randn(max(SILU_ROWS), 2 * IN_FEATURES, generator=torch.Generator().manual_seed(4))
    hidden = kernel_variant.silu_mul(gate_up)
    torch.testing.assert_close(hidden, F.silu(gate_up[:, :IN_FEATURES]) * gate_up[:, IN_FEATURES:])
    expected = [_rounded(hidden, w[i * n : (i + 1) * n], act_group(t)) for i, t in enumerate(types)]
    for m in SILU_ROWS:
        out = kernel_variant.quant_linear_silu(gate_up[:m], weight.data, weight.meta)
        assert torch.equal(out, kernel_variant.quant_linear(hidden[:m], weight.data, weight.meta)), m
        for i, (exp, sc) in enumerate(expected):
            assert ((out[:, i * n : (i + 1) * n].double() - exp[:m]).abs() / sc[:m]).max() < 1e-5, (m, i)


def test_silu_with_an_exact_part_takes_the_two_steps(kernel_variant) -> None:
    """A matrix with an exact part (8-bit groups of 16 no quad layout takes) needs the fp32 product: the same
    result as silu_mul then quant_linear; a gate | up of the wrong width is refused."""
    width = kernel_variant.quant_tile_rows()
    weight, w = _weights(("Q4_K",), width, IN_FEATURES, width, q8=True, exact_rows=width)
    gate_up = torch.randn(9, 2 * IN_FEATURES, generator=torch.Generator().manual_seed(6))
    out = kernel_variant.quant_linear_silu(gate_up, weight.data, weight.meta)
    hidden = kernel_variant.silu_mul(gate_up)
    assert torch.equal(out, kernel_variant.quant_linear(hidden, weight.data, weight.meta))
    assert_fp32_matmul(out[:, width:], hidden, w[width:])
    with pytest.raises(RuntimeError, match="gate_up has"):
        kernel_variant.quant_linear_silu(gate_up[:, 2:].contiguous(), weight.data, weight.meta)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel_variant.quant_linear_silu(gate_up[:, 2:], weight.data, weight.meta)


def test_assert_helpers_fail_on_a_wrong_product() -> None:
    """The helpers this file leans on do reject a wrong result (a check that cannot fail is no check)."""
    x, w = torch.randn(3, 64), torch.randn(5, 64)
    with pytest.raises(AssertionError):
        assert_fp32_matmul(x @ w.T + 1e-3, x, w)
