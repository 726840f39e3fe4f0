"""GGUF blocks kept quantized (``model/gguf_blocks.py``, ``csrc/quant_linear.h``) against the ``gguf`` package.

The block rewrite must reproduce ``gguf.quants.dequantize`` bit for bit for every type; the kernel, on every
variant this CPU runs, must match ``dequantize`` followed by a float64 matmul, for the model's shapes and odd
ones (rows not a multiple of a tile, 1 to 300 rows of x, fused parts of different types).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from tiny_models import random_blocks

from tokenmill.model.gguf_blocks import (
    FORMATS,
    LAYOUT_BYTE_QUADS,
    LAYOUT_BYTE_QUADS_FACTORED,
    LAYOUT_EXACT_QUADS,
    LAYOUT_FACTORED,
    LAYOUT_FIVE_BIT_QUADS,
    LAYOUT_FIVE_BIT_QUADS_FACTORED,
    LAYOUT_FP16_HEAD,
    LAYOUT_GROUP_ACTS,
    LAYOUT_INPUTS,
    LAYOUT_QUADS,
    LAYOUT_QUADS_FACTORED,
    LAYOUT_SIX_BIT_QUADS,
    LAYOUT_SIX_BIT_QUADS_FACTORED,
    LAYOUT_WIDE_BYTE_QUADS,
    BlockFormat,
    Groups,
    QuantizedWeight,
    factored,
    fp16_head,
    group_values,
    pack_groups,
    requantize_4bit,
    to_groups,
)


def reference(type_name: str, raw: np.ndarray, in_features: int) -> torch.Tensor:
    qtype = gguf.GGMLQuantizationType[type_name]
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(raw.shape[0], in_features))


def quantized(
    type_name: str, rows: int, in_features: int, seed: int, tile_rows: int
) -> tuple[QuantizedWeight, torch.Tensor]:
    raw = random_blocks(type_name, rows, in_features, seed)
    weight = QuantizedWeight.from_groups([to_groups(type_name, raw, in_features)], tile_rows)
    return weight, reference(type_name, raw, in_features)


def assert_fp32_matmul(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """``out`` is ``x @ w.T`` up to fp32 summation error: relative to ``|x| @ |w|.T``, under 1e-5."""
    expected = x.double() @ w.double().T
    scale = (x.double().abs() @ w.double().abs().T).clamp_min(1e-30)
    assert ((out.double() - expected).abs() / scale).max() < 1e-5


def _k(type_name: str) -> int:
    """Weights per block of the type (256 for K-quants and IQ4_XS, else 32)."""
    return int(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0])


@pytest.mark.parametrize("type_name", sorted(FORMATS))
@pytest.mark.parametrize(("rows", "tile_rows"), [(1, 8), (7, 16), (64, 32), (33, 32)])
def test_rewritten_blocks_dequantize_bit_for_bit(type_name: str, rows: int, tile_rows: int) -> None:
    in_features = 3 * _k(type_name)
    weight, expected = quantized(type_name, rows, in_features, seed=rows, tile_rows=tile_rows)
    assert weight.out_features == rows and weight.in_features == in_features
    assert torch.equal(weight.dequantize(), expected)


@pytest.mark.parametrize("type_name", sorted(FORMATS))
def test_kernel_rows_are_the_reference_rows(kernel_variant, type_name: str) -> None:
    """The embedding lookup's C++ path: rows decoded by the kernel's own block code, exactly."""
    in_features = 2 * _k(type_name)
    weight, expected = quantized(
        type_name, 45, in_features, seed=3, tile_rows=kernel_variant.quant_tile_rows()
    )
    ids = torch.tensor([0, 44, 5, 5, 33, 17], dtype=torch.int64)
    assert torch.equal(kernel_variant.quant_rows(weight.data, weight.meta, ids), expected[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        kernel_variant.quant_rows(weight.data, weight.meta, torch.tensor([45]))


K_QUANTS = [t for t in sorted(FORMATS) if _k(t) == 256]


@pytest.mark.parametrize("type_name", K_QUANTS)
def test_factored_layout_holds_the_same_weights_in_fewer_bytes(kernel_variant, type_name: str) -> None:
    """A K-quant's scales (and mins) kept as multipliers of an fp16 unit per super-block (layout 2: int8, or six bits
    for groups of 32 with a min) against the same groups with fp32 scales per group (layout 0): fewer bytes, the
    same weights, and the kernel's outputs the same bits on every path (one row, a few rows in registers, an
    expanded panel) and in the row lookup."""
    width = kernel_variant.quant_tile_rows()
    in_features = 2 * 256
    raw = random_blocks(type_name, width + 5, in_features, seed=11)
    groups = to_groups(type_name, raw, in_features)
    # a byte a code (quad_bits=8): layouts 2 and 0 (the narrow quads' bytes: the next test)
    small = QuantizedWeight.from_groups([groups], width, quad_bits=8)
    plain = QuantizedWeight.from_groups([groups._replace(scale_unit=None, min_unit=None)], width, quad_bits=8)
    assert int(small.meta[0, 8]) == LAYOUT_FACTORED and int(plain.meta[0, 8]) == LAYOUT_INPUTS
    # per row and group: 4 bytes a field before; now a byte a field (1.5 bytes for both fields of 6 bits), plus
    # 2 bytes a field per 256 inputs
    fmt = FORMATS[type_name]
    fields, num_groups, num_super = (2 if fmt.has_min else 1), in_features // fmt.group, in_features // 256
    head = 1.5 if fmt.has_min and fmt.group == 32 else fields
    saved = (4 * fields * num_groups - head * num_groups - 2 * fields * num_super) * (2 * width)  # 2 tiles
    assert plain.data.numel() - small.data.numel() == saved
    assert torch.equal(small.dequantize(), plain.dequantize())
    assert torch.equal(small.dequantize(), reference(type_name, raw, in_features))
    assert_same_outputs(kernel_variant, small, plain, seed=5, ids=[0, width + 4, 3, width])


NARROW_TYPES = ("Q6_K", "Q5_0", "Q5_1", "Q5_K", "Q3_K", "Q2_K")  # codes that fit six or five bits


@pytest.mark.parametrize("type_name", NARROW_TYPES)
def test_exact_path_reads_narrow_quads_in_the_files_bits(kernel_variant, type_name: str) -> None:
    """The exact path's layout for the formats whose codes fit six or five bits: the 8-bit path's narrow quads
    (layouts 6 to 9) flagged exact, fewer bytes than a byte a code, the same weights, and the same output bits as
    the byte-a-code layouts on every path and in the row lookup."""
    width = kernel_variant.quant_tile_rows()
    in_features = 2 * 256
    raw = random_blocks(type_name, width + 5, in_features, seed=13)
    groups = to_groups(type_name, raw, in_features)
    narrow = QuantizedWeight.from_groups([groups], width)
    wide = QuantizedWeight.from_groups([groups], width, quad_bits=8)
    layout = int(narrow.meta[0, 8])
    five = type_name != "Q6_K"
    base = (
        (LAYOUT_FIVE_BIT_QUADS, LAYOUT_FIVE_BIT_QUADS_FACTORED)
        if five
        else (LAYOUT_SIX_BIT_QUADS, LAYOUT_SIX_BIT_QUADS_FACTORED)
    )
    assert layout & LAYOUT_EXACT_QUADS and layout & ~(LAYOUT_EXACT_QUADS | LAYOUT_FP16_HEAD) in base
    assert int(narrow.meta[0, 3]) == (5 if five else 6) and not narrow.int8_activations
    assert narrow.type_summary() == f"{5 if five else 6}bit/g{FORMATS[type_name].group}"
    code_bytes = 2 * width * in_features  # two tiles, a byte a code
    assert wide.data.numel() - narrow.data.numel() == code_bytes * (3 if five else 2) // 8
    assert torch.equal(narrow.dequantize(), reference(type_name, raw, in_features))
    assert torch.equal(narrow.dequantize(), wide.dequantize())
    assert_same_outputs(kernel_variant, narrow, wide, seed=7, ids=[0, width + 4, 3, width])


def test_exact_flag_is_refused_outside_the_narrow_quads(kernel_variant) -> None:
    """Flag 32 on a layout other than 6 to 9: a ValueError when packing, a RuntimeError in the kernel."""
    width = kernel_variant.quant_tile_rows()
    groups = to_groups("Q4_K", random_blocks("Q4_K", width, 256, seed=1), 256)
    with pytest.raises(ValueError, match="layouts 6 to 9"):
        pack_groups(groups, width, LAYOUT_FACTORED | LAYOUT_EXACT_QUADS)
    weight = QuantizedWeight.from_groups([groups], width)
    meta = weight.meta.clone()
    meta[0, 8] |= LAYOUT_EXACT_QUADS
    with pytest.raises(RuntimeError, match="takes layouts 6 to 9"):
        kernel_variant.quant_linear(torch.zeros(1, 256), weight.data, meta)


def assert_same_outputs(kernel, a: QuantizedWeight, b: QuantizedWeight, seed: int, ids: list[int]) -> None:
    """Two layouts of the same weights give the same bits: one row, a few rows in registers, an expanded panel
    (both per-call paths), and the row lookup of ``ids``."""
    x = torch.randn(40, a.in_features, generator=torch.Generator().manual_seed(seed))
    for m in (1, 2, 3, 5, 8, 9, 40):
        for once in (-1, 0):
            assert torch.equal(
                kernel.quant_linear(x[:m], a.data, a.meta, expand_once_bytes=once),
                kernel.quant_linear(x[:m], b.data, b.meta, expand_once_bytes=once),
            ), (m, once)
    rows = torch.tensor(ids, dtype=torch.int64)
    assert torch.equal(kernel.quant_rows(a.data, a.meta, rows), kernel.quant_rows(b.data, b.meta, rows))


def test_scales_that_are_not_unit_multiples_keep_fp32_scales() -> None:
    """Groups whose scales are not exactly their unit times an int8 (a nudged scale, a unit too small) take
    layout 0: factoring never changes a weight."""
    groups = to_groups("Q4_K", random_blocks("Q4_K", 8, 256, seed=2), 256)
    assert factored(groups)
    nudged = groups.scale.copy()
    nudged[3, 2] = np.nextafter(nudged[3, 2], np.float32(np.inf))
    assert not factored(groups._replace(scale=nudged))
    assert not factored(groups._replace(scale_unit=groups.scale_unit / 1024))  # multipliers past int8
    mult = np.rint(groups.scale / np.repeat(groups.scale_unit, 8, axis=1))
    for unit, kept in ((1 + 2**-10, True), (1 + 2**-12, False)):  # an fp16, and a value fp16 cannot hold
        unit_arr = np.full_like(groups.scale_unit, unit)
        assert (
            factored(groups._replace(scale=(mult * np.float32(unit)).astype(np.float32), scale_unit=unit_arr))
            is kept
        )
    wide = mult.copy()
    wide[0, 0] = 64  # past six bits: Q4_K's multipliers are kept in six
    unit_rep = np.repeat(groups.scale_unit, 8, axis=1)
    assert not factored(groups._replace(scale=(wide * unit_rep).astype(np.float32)))
    weight = QuantizedWeight.from_groups([groups._replace(scale=nudged)], 8)
    assert int(weight.meta[0, 8]) == LAYOUT_INPUTS


SMALL_BLOCK_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"]


@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize("type_name", SMALL_BLOCK_TYPES)
def test_fp16_heads_hold_the_same_weights_in_the_files_bytes(
    kernel_variant, type_name: str, int8_activations: bool
) -> None:
    """The formats without super-blocks keep each group's fp16 scale (and min) in fp16 (layout flag 16) against the
    same groups with fp32 heads: 2 bytes a field saved per row and group (Q4_1 and Q8_0 then in their file's bytes
    exactly), the same weights, and the kernel's outputs the same bits on every path and in the row lookup."""
    width = kernel_variant.quant_tile_rows()
    in_features = 3 * 32 * 4  # groups of 32, K a multiple of 128
    raw = random_blocks(type_name, 2 * width, in_features, seed=17)  # whole tiles: no padding rows
    groups = to_groups(type_name, raw, in_features)
    half = QuantizedWeight.from_groups([groups], width, int8_activations)
    full = QuantizedWeight.from_groups([groups], width, int8_activations, fp16_heads=False)
    assert int(half.meta[0, 8]) & LAYOUT_FP16_HEAD and not int(full.meta[0, 8]) & LAYOUT_FP16_HEAD
    assert half.type_summary() == full.type_summary() and half.int8_activations == full.int8_activations
    fields = 2 if FORMATS[type_name].has_min else 1
    assert full.data.numel() - half.data.numel() == 2 * fields * (in_features // 32) * 2 * width
    if type_name in ("Q4_1", "Q8_0"):
        assert half.data.numel() == raw.nbytes
    assert torch.equal(half.dequantize(), full.dequantize())
    assert torch.equal(half.dequantize(), reference(type_name, raw, in_features))
    assert_same_outputs(kernel_variant, half, full, seed=6, ids=[0, width + 4, 3, 2 * width - 1])


def test_scales_fp16_cannot_hold_keep_fp32_heads() -> None:
    """A scale that is not an fp16 value (a nudged one, a requantized part's) or a Q4_0 min that overflows fp16
    (-8 d past 65504) keeps the fp32 head: an fp16 head never changes a weight; asking for one is refused."""
    groups = to_groups("Q4_1", random_blocks("Q4_1", 8, 64, seed=3), 64)
    assert fp16_head(groups)
    nudged = groups.scale.copy()
    nudged[2, 1] = np.nextafter(nudged[2, 1], np.float32(np.inf))
    assert not fp16_head(groups._replace(scale=nudged))
    assert int(QuantizedWeight.from_groups([groups._replace(scale=nudged)], 8).meta[0, 8]) == LAYOUT_INPUTS
    with pytest.raises(ValueError, match="fp16 head"):
        pack_groups(groups._replace(scale=nudged), 8, LAYOUT_INPUTS | LAYOUT_FP16_HEAD)
    q4_0 = to_groups("Q4_0", random_blocks("Q4_0", 8, 64, seed=4), 64)
    big = np.full_like(q4_0.scale, 16384.0)  # an fp16 whose -8 d is not one
    assert fp16_head(q4_0) and not fp16_head(q4_0._replace(scale=big, min=big * np.float32(-8)))
    assert not fp16_head(to_groups("Q6_K", random_blocks("Q6_K", 8, 256, seed=5), 256))  # groups of 16


# (x rows, out, type): the embedded model's shapes and odd ones
KERNEL_CASES = [
    (1, 960, 576, "Q4_1"),
    (4, 576, 576, "Q4_1"),
    (8, 100, 576, "Q4_1"),
    (9, 100, 576, "Q4_1"),
    (1, 576, 1536, "Q4_1"),
    (3, 3072, 576, "Q4_1"),
    (300, 93, 576, "Q4_1"),
    (1, 5, 576, "Q8_0"),
    (17, 49, 96, "Q8_0"),
    (2, 30, 64, "Q4_0"),
    (5, 11, 512, "Q4_K"),
    (130, 6, 256, "Q4_K"),
    (1, 70, 1536, "Q4_K"),
    (7, 33, 512, "Q4_K"),
    (300, 40, 256, "Q4_K"),
    (1000, 40, 1536, "Q4_K"),
    (1, 9, 768, "Q5_K"),
    (64, 3, 256, "Q5_K"),
    (1, 7, 512, "Q6_K"),
    (33, 18, 256, "Q6_K"),
]


@pytest.mark.parametrize(("num_rows", "out_features", "in_features", "type_name"), KERNEL_CASES)
def test_kernel_matches_dequantize_then_float64(
    kernel_variant, num_rows, out_features, in_features, type_name
):
    width = kernel_variant.quant_tile_rows()
    weight, w = quantized(type_name, out_features, in_features, seed=num_rows + out_features, tile_rows=width)
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(num_rows))
    assert_fp32_matmul(kernel_variant.quant_linear(x, weight.data, weight.meta), x, w)


def test_fused_parts_of_different_types(kernel_variant) -> None:
    """A fused qkv of Q4_K, Q4_K and Q6_K rows: each part keeps its format, outputs side by side."""
    in_features = 512
    raws = [
        random_blocks(t, r, in_features, seed)
        for t, r, seed in (("Q4_K", 9, 1), ("Q4_K", 6, 2), ("Q6_K", 5, 3))
    ]
    types = ("Q4_K", "Q4_K", "Q6_K")
    groups = [to_groups(t, r, in_features) for t, r in zip(types, raws)]
    weight = QuantizedWeight.from_groups(groups, kernel_variant.quant_tile_rows())
    w = torch.cat([reference(t, r, in_features) for t, r in zip(types, raws)])
    assert weight.type_summary() == "4bit/g32+4bit/g32+6bit/g16"
    assert torch.equal(weight.dequantize(), w)
    x = torch.randn(4, in_features, generator=torch.Generator().manual_seed(0))
    assert_fp32_matmul(kernel_variant.quant_linear(x, weight.data, weight.meta), x, w)
    ids = torch.arange(20)
    assert torch.equal(kernel_variant.quant_rows(weight.data, weight.meta, ids), w)


def test_kernel_refuses_bad_meta(kernel_variant) -> None:
    weight, _ = quantized("Q4_1", 8, 64, seed=0, tile_rows=kernel_variant.quant_tile_rows())
    x = torch.randn(1, 64)
    short = weight.data[:-1].clone()
    with pytest.raises(RuntimeError, match="past the data"):
        kernel_variant.quant_linear(x, short, weight.meta)
    bad = weight.meta.clone()
    bad[0, 3] = 5
    with pytest.raises(RuntimeError, match="no block format"):
        kernel_variant.quant_linear(x, weight.data, bad)
    with pytest.raises(RuntimeError, match="features"):
        kernel_variant.quant_linear(torch.randn(1, 32), weight.data, weight.meta)
    other = weight.meta.clone()
    other[0, 7] = 2 * kernel_variant.quant_tile_rows()
    with pytest.raises(RuntimeError, match="tiles of"):
        kernel_variant.quant_linear(x, weight.data, other)


def test_unsupported_type_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="IQ2_XXS"):
        to_groups("IQ2_XXS", np.zeros((1, 66), np.uint8), 256)


# --- the 8-bit-activation path (quantization="gguf-q8"): 4-bit parts in the quad layout, 8-bit parts whose
# codes lie in -32..31 in byte quads ---------------------------------------------------------------------------

BYTE_QUAD_TYPES = ["Q6_K", "Q5_0", "Q5_1", "Q5_K", "Q3_K", "Q2_K"]
QUAD_CODE_BITS = {"Q6_K": 6, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q3_K": 5, "Q2_K": 5}  # what the loader writes


K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def act_group(type_name: str) -> int:
    """How many inputs share an activation scale in front of a GGUF type: a K-quant's super-block (llama.cpp's
    Q8_K), else a group of 32 (its Q8_0 and Q8_1)."""
    return 256 if type_name in K_QUANTS else 32


def round_activations(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """The activations as the kernel is specified to round them, written independently of it: per row and group
    of ``group`` inputs (32, or a K-quant's 256), s = max|x| / 127 (fp32), code = round half to even(x * (1 / s))
    in [-127, 127]; returns code * s in float64 (0 for an all-zero group)."""
    rows, k = x.shape
    groups = x.view(rows, k // group, group)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    s = amax / 127
    inv = torch.where(amax > 0, 1.0 / s, torch.zeros_like(s))
    codes = torch.round(groups * inv).clamp(-127, 127)
    return (codes.double() * s.double()).view(rows, k)


def quad_weight(type_name: str, rows: int, in_features: int, seed: int, tile_rows: int):
    raw = random_blocks(type_name, rows, in_features, seed)
    groups = to_groups(type_name, raw, in_features)
    return QuantizedWeight.from_groups([groups], tile_rows, int8_activations=True), reference(
        type_name, raw, in_features
    )


WIDE_BYTE_QUAD_TYPES = ["Q8_0", "IQ4_NL", "IQ4_XS"]  # 8-bit codes across -128..127


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K", *BYTE_QUAD_TYPES, *WIDE_BYTE_QUAD_TYPES])
@pytest.mark.parametrize("tile_rows", [8, 16, 32])
def test_quad_layout_holds_the_same_weights(type_name: str, tile_rows: int) -> None:
    weight, expected = quad_weight(type_name, 37, 2 * _k(type_name), seed=tile_rows, tile_rows=tile_rows)
    fmt = FORMATS[type_name]
    bits = QUAD_CODE_BITS.get(type_name, fmt.bits)  # the 8-bit formats' codes in five or six bits a code
    assert weight.int8_activations and weight.type_summary() == f"{bits}bit/g{fmt.group}/x8"
    factored = type_name.endswith("_K")  # the K-quants keep their factored scales, 4-bit ones too
    half = 0 if factored else LAYOUT_FP16_HEAD  # the others' scales are the file's fp16 values
    if type_name in WIDE_BYTE_QUAD_TYPES:
        assert int(weight.meta[0, 8]) & ~LAYOUT_FP16_HEAD == LAYOUT_WIDE_BYTE_QUADS
        if type_name != "IQ4_XS":  # a super-block's unit times a signed multiplier need not be an fp16 value
            assert int(weight.meta[0, 8]) & LAYOUT_FP16_HEAD
    elif bits == 6:
        assert weight.meta[0, 8] == (
            LAYOUT_SIX_BIT_QUADS_FACTORED if factored else LAYOUT_SIX_BIT_QUADS | half
        )
    elif bits == 5:
        assert weight.meta[0, 8] == (
            LAYOUT_FIVE_BIT_QUADS_FACTORED if factored else LAYOUT_FIVE_BIT_QUADS | half
        )
    else:
        assert weight.meta[0, 8] == (LAYOUT_QUADS_FACTORED if factored else LAYOUT_QUADS | half)
    assert torch.equal(weight.dequantize(), expected)
    ids = torch.tensor([36, 0, 17])
    assert torch.equal(weight.dequantize(ids), expected[ids])


Q8_CASES = [
    (1, 960, 576, "Q4_1"),
    (3, 576, 1536, "Q4_1"),
    (9, 100, 576, "Q4_1"),
    (300, 93, 576, "Q4_1"),
    (2, 30, 64, "Q4_0"),
    (130, 6, 256, "Q4_K"),
    (1, 70, 1536, "Q4_K"),
    (7, 33, 512, "Q4_K"),
    (300, 40, 256, "Q4_K"),
    (1, 200, 512, "Q6_K"),
    (5, 70, 768, "Q6_K"),
    (300, 33, 256, "Q6_K"),
    (1, 70, 576, "Q8_0"),
    (5, 33, 96, "Q8_0"),
    (300, 40, 256, "Q8_0"),
    (4, 37, 128, "IQ4_NL"),
    (6, 20, 256, "IQ4_XS"),
    (3, 40, 64, "Q5_0"),
    (7, 40, 96, "Q5_1"),
    (2, 41, 512, "Q5_K"),
    (9, 17, 256, "Q3_K"),
    (13, 50, 512, "Q2_K"),
]


@pytest.mark.parametrize(("num_rows", "out_features", "in_features", "type_name"), Q8_CASES)
def test_int8_activation_kernel_against_rounded_activations_in_float64(
    kernel_variant, num_rows, out_features, in_features, type_name
):
    """Integer dot products are exact, so the kernel equals the rounded activations times the dequantized
    weights in float64 up to fp32 rounding of the scales and the per-group sums; and it is within the
    rounding's bound (s / 2 per activation: 1/254 of max|x| over the inputs that share s, 32 or a K-quant's
    super-block of 256) of the exact product."""
    width = kernel_variant.quant_tile_rows()
    weight, w = quad_weight(type_name, out_features, in_features, seed=num_rows, tile_rows=width)
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(num_rows))
    x[0, : act_group(type_name)] = 0.0  # an all-zero group: code 0, no division by zero
    out = kernel_variant.quant_linear(x, weight.data, weight.meta).double()
    group = act_group(type_name)
    rounded = round_activations(x, group)
    expected = rounded @ w.double().T
    scale = (rounded.abs() @ w.double().abs().T).clamp_min(1e-30)
    assert ((out - expected).abs() / scale).max() < 1e-5
    exact = x.double() @ w.double().T
    half_steps = x.view(num_rows, -1, group).abs().amax(-1, keepdim=True).expand(-1, -1, group) / 254  # s / 2
    bound = half_steps.reshape(num_rows, in_features).double() @ w.double().abs().T
    assert ((out - exact).abs() <= bound * 1.001 + 1e-5 * scale).all()


def test_factored_quads_hold_a_k_quant_in_fewer_bytes_and_compute_the_same(kernel_variant) -> None:
    """Q4_K in quads with its scales as int8 multipliers of a unit per super-block (layout 5) against the same
    groups with fp32 scales (layout 1): about 4.75 bits a weight instead of 6, the same weights; with the
    activations rounded per group of 32 for both (flag 64), the same outputs bit for bit on every row count."""
    width = kernel_variant.quant_tile_rows()
    raw = random_blocks("Q4_K", 64, 1024, 11)
    groups = to_groups("Q4_K", raw, 1024)
    factored_w = QuantizedWeight.from_groups([groups], width, int8_activations=True, super_block_acts=False)
    plain_data = torch.from_numpy(pack_groups(groups, width, LAYOUT_QUADS))
    plain_meta = factored_w.meta.clone()
    plain_meta[0, 8] = LAYOUT_QUADS
    assert factored_w.meta[0, 8] == LAYOUT_QUADS_FACTORED | LAYOUT_GROUP_ACTS
    assert factored_w.data.numel() * 8 / (64 * 1024) < 4.9 < plain_data.numel() * 8 / (64 * 1024)
    assert torch.equal(factored_w.dequantize(), QuantizedWeight(plain_data, plain_meta).dequantize())
    x = torch.randn(300, 1024, generator=torch.Generator().manual_seed(2))
    for rows in (1, 2, 7, 64, 300):
        a = kernel_variant.quant_linear(x[:rows], factored_w.data, factored_w.meta)
        b = kernel_variant.quant_linear(x[:rows], plain_data, plain_meta)
        assert torch.equal(a, b), rows
    ids = torch.tensor([0, 63, 17])
    assert torch.equal(
        kernel_variant.quant_rows(factored_w.data, factored_w.meta, ids), factored_w.dequantize(ids)
    )


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_K", "Q3_K", "Q2_K"])
def test_a_k_quants_activations_share_a_scale_per_super_block_unless_flagged(
    kernel_variant, type_name
) -> None:
    """One large group in each super-block of 256 and seven small ones: with the scale of the super-block (llama.cpp's
    Q8_K) the small ones round to a few codes, with a scale per 32 they keep theirs. The kernel follows the reference
    of each rounding, and flag 64 (``super_block_acts=False``) switches between them; the bytes are the same."""
    width = kernel_variant.quant_tile_rows()
    raw = random_blocks(type_name, width + 5, 512, seed=3)
    groups = to_groups(type_name, raw, 512)
    w = reference(type_name, raw, 512).double()
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(5)) * 0.01
    x[:, ::256] = 30.0  # the first input of each super-block
    per_super = QuantizedWeight.from_groups([groups], width, int8_activations=True)
    per_group = QuantizedWeight.from_groups([groups], width, int8_activations=True, super_block_acts=False)
    assert int(per_group.meta[0, 8]) == int(per_super.meta[0, 8]) | LAYOUT_GROUP_ACTS
    assert torch.equal(per_super.data, per_group.data)
    for weight, group in ((per_super, 256), (per_group, 32)):
        for num_rows in (1, 6, 9):
            out = kernel_variant.quant_linear(x[:num_rows], weight.data, weight.meta).double()
            rounded = round_activations(x[:num_rows], group)
            scale = (rounded.abs() @ w.abs().T).clamp_min(1e-30)
            assert ((out - rounded @ w.T).abs() / scale).max() < 1e-5, (group, num_rows)
    assert not torch.allclose(round_activations(x, 256), round_activations(x, 32), rtol=0.1)


def test_the_group_activations_flag_takes_the_factored_quad_layouts_only(kernel_variant) -> None:
    weight, _ = quad_weight("Q4_1", 8, 64, seed=0, tile_rows=kernel_variant.quant_tile_rows())
    bad = weight.meta.clone()
    bad[0, 8] |= LAYOUT_GROUP_ACTS
    with pytest.raises(RuntimeError, match="flag 64"):
        kernel_variant.quant_linear(torch.ones(1, 64), weight.data, bad)


@pytest.mark.parametrize("width", [8, 16, 32])
@pytest.mark.parametrize(
    ("type_name", "int8_activations"),
    [("Q4_K", True), ("Q6_K", True), ("Q4_K", False), ("Q5_0", True), ("Q5_1", True), ("Q5_K", True)],
)
def test_k_quants_and_five_bit_types_keep_their_files_bytes(
    type_name: str, int8_activations: bool, width: int
) -> None:
    """Q4_K_M's types as a decode step reads them, on llama.cpp's arithmetic (and Q4_K on the exact one): the same
    number of bytes as the file's blocks (Q4_K's 4.5 bits a weight, Q6_K's 6.5625; Q5_0's 5.5, Q5_1's 6 and
    Q5_K's 5.5, where a file's rows do not fit Q4_K or Q6_K), and the same weights."""
    raw = random_blocks(type_name, 2 * width, 512, seed=width)
    weight = QuantizedWeight.from_groups([to_groups(type_name, raw, 512)], width, int8_activations)
    assert weight.data.numel() == raw.nbytes
    assert torch.equal(weight.dequantize(), reference(type_name, raw, 512))


@pytest.mark.parametrize("type_name", BYTE_QUAD_TYPES)
def test_narrow_quads_hold_the_byte_quads_codes_in_five_or_six_bits(kernel_variant, type_name) -> None:
    """Every byte-quad format as the loader writes it (five bits a code where the codes fit: layouts 8 and 9; else
    six: layouts 6 and 7), in six bits (``quad_bits=6``) and as byte quads (layouts 3 and 4): the same weights, the
    same outputs bit for bit on every row count and in the lookup, in 5/8 or 3/4 of the code bytes (Q6_K within
    1.01x of its file's 6.5625 bits a weight)."""
    width = kernel_variant.quant_tile_rows()
    in_features = 1024
    raw = random_blocks(type_name, 2 * width + 5, in_features, 13)  # a partial tile too
    groups = to_groups(type_name, raw, in_features)
    narrow = QuantizedWeight.from_groups([groups], width, int8_activations=True)
    six = QuantizedWeight.from_groups([groups], width, int8_activations=True, quad_bits=6)
    bits = QUAD_CODE_BITS[type_name]
    is_factored = factored(groups)
    half = 0 if is_factored else LAYOUT_FP16_HEAD
    six_layout = LAYOUT_SIX_BIT_QUADS_FACTORED if is_factored else LAYOUT_SIX_BIT_QUADS | half
    five_layout = LAYOUT_FIVE_BIT_QUADS_FACTORED if is_factored else LAYOUT_FIVE_BIT_QUADS | half
    assert narrow.meta[0, 8] == (five_layout if bits == 5 else six_layout) and six.meta[0, 8] == six_layout
    assert narrow.meta[0, 3] == bits and six.meta[0, 3] == 6
    byte_layout = LAYOUT_BYTE_QUADS_FACTORED if is_factored else LAYOUT_BYTE_QUADS | half
    byte_meta = narrow.meta.clone()
    byte_meta[0, 3], byte_meta[0, 8] = 8, byte_layout
    byte = QuantizedWeight(torch.from_numpy(pack_groups(groups, width, byte_layout)), byte_meta)
    assert torch.equal(
        QuantizedWeight.from_groups([groups], width, int8_activations=True, quad_bits=8).data, byte.data
    )
    num_tiles = -(-groups.codes.shape[0] // width)
    codes = num_tiles * width * in_features
    heads = byte.data.numel() - codes  # scales, mins, units: the same in every layout
    assert narrow.data.numel() - heads == codes * bits // 8 and six.data.numel() - heads == codes * 3 // 4
    if type_name == "Q6_K":
        assert narrow.data.numel() * 8 / codes <= 6.5625 * 1.01
    expected = reference(type_name, raw, in_features)
    for weight in (narrow, six, byte):
        assert torch.equal(weight.dequantize(), expected)
    x = torch.randn(300, in_features, generator=torch.Generator().manual_seed(4))
    for rows in (1, 2, 3, 4, 5, 6, 7, 13, 64, 300):
        a = kernel_variant.quant_linear(x[:rows], narrow.data, narrow.meta)
        assert torch.equal(a, kernel_variant.quant_linear(x[:rows], byte.data, byte.meta)), rows
        assert torch.equal(a, kernel_variant.quant_linear(x[:rows], six.data, six.meta)), rows
    ids = torch.tensor([0, width - 1, width, 2 * width + 4])
    assert torch.equal(kernel_variant.quant_rows(narrow.data, narrow.meta, ids), expected[ids])


@pytest.mark.parametrize(
    ("type_name", "in_features"), [("Q4_1", 576), ("Q6_K", 512), ("Q5_0", 576), ("Q8_0", 576)]
)
def test_int8_activation_rows_do_not_depend_on_the_batch(
    kernel_variant, type_name: str, in_features: int
) -> None:
    """Each row's activations are rounded on their own and every row count runs the same arithmetic: a row's
    output is bit for bit the same alone, in a decode-sized batch and in a prefill-sized one."""
    width = kernel_variant.quant_tile_rows()
    weight, _ = quad_weight(type_name, 70, in_features, seed=5, tile_rows=width)
    x = torch.randn(300, in_features, generator=torch.Generator().manual_seed(1))
    full = kernel_variant.quant_linear(x, weight.data, weight.meta)
    for rows in (slice(0, 1), slice(3, 4), slice(0, 7), slice(100, 164)):
        assert torch.equal(kernel_variant.quant_linear(x[rows], weight.data, weight.meta), full[rows])


def wide_groups_of_16(rows: int, in_features: int, seed: int) -> Groups:
    """8-bit groups of 16 without a min whose codes span -128..127: no GGUF type, the one block format left that no
    quad layout takes (the 8-bit-activation kernel keeps such a part exact)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(-128, 128, size=(rows, in_features // 16, 16)).astype(np.int8)
    scale = rng.uniform(1e-3, 1e-2, size=(rows, in_features // 16)).astype(np.float32)
    return Groups(BlockFormat(8, 16, False), codes.view(np.uint8), scale, None)


def test_int8_activations_take_every_gguf_part_and_leave_the_rest_exact(kernel_variant) -> None:
    """A fused Q4_K + Q6_K + Q8_0 matrix and a part of 8-bit groups of 16 spanning -128..127: the three GGUF parts
    take the rounded activations (Q8_0 as wide byte quads), the last stays exact beside them."""
    in_features = 512
    types = (("Q4_K", 9, 1), ("Q6_K", 5, 3), ("Q8_0", 4, 2))
    raws = [random_blocks(t, r, in_features, seed) for t, r, seed in types]
    groups = [to_groups(t, r, in_features) for (t, _, _), r in zip(types, raws)]
    exact_part = wide_groups_of_16(3, in_features, seed=4)
    weight = QuantizedWeight.from_groups(
        [*groups, exact_part], kernel_variant.quant_tile_rows(), int8_activations=True
    )
    assert weight.type_summary() == "4bit/g32/x8+6bit/g16/x8+8bit/g32/x8+8bit/g16"
    assert int(weight.meta[2, 8]) == LAYOUT_WIDE_BYTE_QUADS | LAYOUT_FP16_HEAD
    w = [reference(t, r, in_features) for (t, _, _), r in zip(types, raws)]
    values = exact_part.codes.view(np.int8).astype(np.float32) * exact_part.scale[..., None]
    w.append(torch.from_numpy(values.reshape(3, in_features)))
    for num_rows in (1, 4, 20):
        x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(num_rows))
        out = kernel_variant.quant_linear(x, weight.data, weight.meta)
        # the K-quants' activations share a scale per super-block of 256, Q8_0's per group of 32
        for (type_name, _, _), part, cols in zip(types, w, (slice(0, 9), slice(9, 14), slice(14, 18))):
            rounded = round_activations(x, act_group(type_name))
            scale = (rounded.abs() @ part.double().abs().T).clamp_min(1e-30)
            assert ((out[:, cols].double() - rounded @ part.double().T).abs() / scale).max() < 1e-5, type_name
        assert_fp32_matmul(out[:, 18:], x, w[3])
    ids = torch.arange(21)
    assert torch.equal(kernel_variant.quant_rows(weight.data, weight.meta, ids), torch.cat(w))


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("quad_bits", [6, 8])
def test_byte_quads_extreme_codes_and_activations(
    kernel_variant, group: int, sign: int, quad_bits: int
) -> None:
    """Codes at the ends of -32..31 times activations at +-127 in every input, where AVX2's pairs of products come
    closest to int16's limit (2 * 63 * 127; a run of two quads' pairs added in int16, 32,004) and a group's sum
    passes it: the sums must be exact integers, in six-bit quads and in byte quads."""
    fmt = BlockFormat(8, group, False)
    rows, in_features = 3, 256
    codes = np.empty((rows, in_features // group, group), np.int8)
    codes[0], codes[1], codes[2] = 31, -32, np.where(np.arange(group) % 2 == 0, 31, -32).astype(np.int8)
    scale = np.full((rows, in_features // group), 0.5, np.float32)
    groups = Groups(fmt, codes.view(np.uint8), scale, None)
    tile_rows = kernel_variant.quant_tile_rows()
    weight = QuantizedWeight.from_groups([groups], tile_rows, int8_activations=True, quad_bits=quad_bits)
    assert weight.type_summary() == f"{quad_bits}bit/g{group}/x8"
    x = torch.full((2, in_features), float(sign))  # codes +-127, s = 1 / 127
    x[1, 1::2] = -sign
    out = kernel_variant.quant_linear(x, weight.data, weight.meta).double()
    expected = round_activations(x) @ weight.dequantize().double().T
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert out[0, 0].item() == pytest.approx(sign * 0.5 * 31 * in_features, rel=1e-6)


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("has_min", [False, True])
def test_five_bit_quads_extreme_codes_and_activations(kernel_variant, group: int, has_min: bool) -> None:
    """Five-bit codes at their ends (-16 and 15 without a min, biased by 16; 0 and 31 with one) times activations
    at +-127: every fifth bit set and clear in every position of a quad, the sums exact integers."""
    fmt = BlockFormat(8, group, has_min)
    rows, in_features = 4, 256
    low, high = (0, 31) if has_min else (-16, 15)
    codes = np.empty((rows, in_features // group, group), np.int8)
    codes[0], codes[1] = high, low
    codes[2] = np.where(np.arange(group) % 2 == 0, high, low)
    codes[3] = np.where(np.arange(group) % 3 == 0, low, high)
    scale = np.full((rows, in_features // group), 0.5, np.float32)
    minimum = np.full_like(scale, -0.25) if has_min else None
    groups = Groups(fmt, codes.view(np.uint8), scale, minimum)
    weight = QuantizedWeight.from_groups([groups], kernel_variant.quant_tile_rows(), int8_activations=True)
    assert weight.type_summary() == f"5bit/g{group}/x8"
    for sign in (1, -1):
        x = torch.full((2, in_features), float(sign))  # codes +-127, s = 1 / 127
        x[1, 1::2] = -sign
        out = kernel_variant.quant_linear(x, weight.data, weight.meta).double()
        expected = round_activations(x) @ weight.dequantize().double().T
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        assert out[0, 0].item() == pytest.approx(sign * (0.5 * high - (0.25 if has_min else 0)) * in_features)


@pytest.mark.parametrize("sign", [1, -1])
def test_wide_byte_quads_extreme_codes_and_activations(kernel_variant, sign: int) -> None:
    """Codes at -128 and 127 times activations at +-127 in every input: AVX2 multiplies |code| (128 at most) by the
    activation given the code's sign, a pair of products at most 2 * 128 * 127 = 32,512, just under int16's limit;
    a group's sum passes it. The sums must be exact integers."""
    fmt = BlockFormat(8, 32, False)
    rows, in_features = 4, 256
    codes = np.empty((rows, in_features // 32, 32), np.int8)
    codes[0], codes[1] = 127, -128
    codes[2] = np.where(np.arange(32) % 2 == 0, 127, -128).astype(np.int8)
    codes[3] = np.where(np.arange(32) % 4 < 2, -128, 0).astype(np.int8)
    scale = np.full((rows, in_features // 32), 0.5, np.float32)
    groups = Groups(fmt, codes.view(np.uint8), scale, None)
    weight = QuantizedWeight.from_groups([groups], kernel_variant.quant_tile_rows(), int8_activations=True)
    assert weight.type_summary() == "8bit/g32/x8"
    assert int(weight.meta[0, 8]) & ~LAYOUT_FP16_HEAD == LAYOUT_WIDE_BYTE_QUADS
    x = torch.full((2, in_features), float(sign))  # codes +-127, s = 1 / 127
    x[1, 1::2] = -sign
    out = kernel_variant.quant_linear(x, weight.data, weight.meta).double()
    expected = round_activations(x) @ weight.dequantize().double().T
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert out[0, 1].item() == pytest.approx(sign * 0.5 * -128 * in_features, rel=1e-6)
    assert out[1, 2].item() == pytest.approx(sign * 0.5 * 255 * in_features / 2, rel=1e-6)


def test_quad_layout_is_for_4_bit_groups_only(kernel_variant) -> None:
    weight, _ = quantized("Q8_0", 8, 64, seed=0, tile_rows=kernel_variant.quant_tile_rows())
    bad = weight.meta.clone()
    bad[0, 8] = 1
    with pytest.raises(RuntimeError, match="layout"):
        kernel_variant.quant_linear(torch.randn(1, 64), weight.data, bad)
    bad[0, 8] = 2
    with pytest.raises(RuntimeError, match="layout"):
        kernel_variant.quant_linear(torch.randn(1, 64), weight.data, bad)
    groups = to_groups("Q8_0", random_blocks("Q8_0", 8, 64, 0), 64)
    with pytest.raises(ValueError, match="quad layout"):
        pack_groups(groups, 8, LAYOUT_QUADS)
    # byte quads: 8-bit codes within -32..31 only (Q8_0's reach -128..127), and never a 4-bit part
    for layout in (
        LAYOUT_BYTE_QUADS,
        LAYOUT_BYTE_QUADS_FACTORED,
        LAYOUT_SIX_BIT_QUADS,
        LAYOUT_SIX_BIT_QUADS_FACTORED,
        LAYOUT_FIVE_BIT_QUADS,
        LAYOUT_FIVE_BIT_QUADS_FACTORED,
    ):
        with pytest.raises(ValueError, match="byte quads"):
            pack_groups(groups, 8, layout)
    # five bits: Q6_K's codes -32..31 do not fit them
    q6 = to_groups("Q6_K", random_blocks("Q6_K", 8, 256, 0), 256)
    for layout in (LAYOUT_FIVE_BIT_QUADS, LAYOUT_FIVE_BIT_QUADS_FACTORED):
        with pytest.raises(ValueError, match="five-bit quads"):
            pack_groups(q6, 8, layout)
    with pytest.raises(ValueError, match="5, 6 or 8 bits"):
        QuantizedWeight.from_groups([q6], 8, int8_activations=True, quad_bits=4)
    # wide byte quads: 8-bit groups of 32 without a min only, in Python and in the kernel
    with pytest.raises(ValueError, match="wide byte quads"):
        pack_groups(q6, 8, LAYOUT_WIDE_BYTE_QUADS)
    q6_quads, _ = quad_weight("Q6_K", 8, 256, seed=0, tile_rows=kernel_variant.quant_tile_rows())
    bad = q6_quads.meta.clone()
    bad[0, 8] = LAYOUT_WIDE_BYTE_QUADS
    with pytest.raises(RuntimeError, match="layout"):
        kernel_variant.quant_linear(torch.randn(1, 256), q6_quads.data, bad)
    q4, _ = quantized("Q4_1", 8, 64, seed=0, tile_rows=kernel_variant.quant_tile_rows())
    for layout in (LAYOUT_BYTE_QUADS, LAYOUT_FIVE_BIT_QUADS):
        bad = q4.meta.clone()
        bad[0, 8] = layout
        with pytest.raises(RuntimeError, match="byte quads"):
            kernel_variant.quant_linear(torch.randn(1, 64), q4.data, bad)
    q5, _ = quad_weight("Q5_0", 8, 64, seed=0, tile_rows=kernel_variant.quant_tile_rows())
    bad = q5.meta.clone()
    bad[0, 3] = 6  # five-bit quads whose meta says six bits a code
    with pytest.raises(RuntimeError, match="byte quads take 5-bit"):
        kernel_variant.quant_linear(torch.randn(1, 64), q5.data, bad)


def _min_max_4bit(values: np.ndarray) -> np.ndarray:
    """The plain min-max 4-bit rounding of ``values [rows, G, 32]`` in float64: the weights it gives."""
    low, high = values.min(axis=-1, keepdims=True), values.max(axis=-1, keepdims=True)
    step = (high - low) / 15
    codes = np.clip(np.rint(np.divide(values - low, step, out=np.zeros_like(values), where=step > 0)), 0, 15)
    return codes * step + low


@pytest.mark.parametrize("type_name", sorted(FORMATS))
def test_requantized_4_bit_weights_fit_better_than_min_max(type_name: str) -> None:
    """``gguf-q4`` (a draft model's weights): every type rounded to 4-bit codes with a min per group of 32. Against
    the ``gguf`` package's values, each group's squared error is at most plain min-max rounding's (the least-squares
    refinement keeps a fit only where it is better) and in all strictly below it; 4-bit groups of 32 with a min
    come back as they are."""
    in_features = 2 * _k(type_name)
    raw = random_blocks(type_name, 9, in_features, seed=5)
    groups = to_groups(type_name, raw, in_features)
    expected = reference(type_name, raw, in_features).numpy()
    assert np.array_equal(group_values(groups), expected)  # the values the requantizer starts from
    q4 = requantize_4bit(groups)
    assert q4.fmt == (4, 32, True) and q4.codes.max() <= 15
    if groups.fmt == (4, 32, True):
        assert q4 is groups
        return
    assert (q4.scale >= 0).all()
    original = expected.reshape(9, -1, 32).astype(np.float64)
    error = ((group_values(q4).reshape(9, -1, 32) - original) ** 2).sum(axis=-1)
    min_max_error = ((_min_max_4bit(original) - original) ** 2).sum(axis=-1)
    assert (error <= min_max_error * (1 + 1e-5) + 1e-12).all()
    assert error.sum() < min_max_error.sum()
    assert np.array_equal(
        requantize_4bit(groups, num_refinements=0).min, original.min(axis=-1).astype(np.float32)
    )
    # through the 8-bit-activation layout, the kernels' weights are these values
    weight = QuantizedWeight.from_groups([q4], 16, int8_activations=True)
    assert weight.type_summary() == "4bit/g32/x8"
    torch.testing.assert_close(weight.dequantize(), torch.from_numpy(group_values(q4)), rtol=2**-23, atol=0)


def test_requantizing_a_constant_group_keeps_it() -> None:
    """A group of equal weights has a zero step: codes 0, the value as its min (no division by zero)."""
    raw = random_blocks("Q8_0", 2, 64, seed=1)
    groups = to_groups("Q8_0", raw, 64)
    codes = groups.codes.copy()
    codes[0, 1] = 7  # row 0, group 1: 32 equal codes
    constant = groups._replace(codes=codes)
    q4 = requantize_4bit(constant)
    assert q4.scale[0, 1] == 0 and (q4.codes[0, 1] == 0).all()
    assert np.array_equal(group_values(q4)[0, 32:64], group_values(constant)[0, 32:64])
