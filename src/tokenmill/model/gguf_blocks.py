"""GGUF quantized tensors kept quantized: their blocks rewritten once into the layout ``csrc/quant_linear.h`` reads.

Each GGUF type tokenmill keeps maps onto one of five block formats (bits, weights per group, whether a group has
a min), every weight being ``code * scale + min`` in fp32:

========  =============================================  ==========================================
GGUF      what a group is in the file                     kept as
========  =============================================  ==========================================
Q4_0      32 weights, fp16 ``d``, ``w = d * (q - 8)``     4-bit, scale ``d``, min ``-8 d``
Q4_1      32 weights, fp16 ``d``, ``m``: ``d * q + m``    4-bit, scale ``d``, min ``m``
Q4_K      8 sub-blocks of 32 in 256, 6-bit scales/mins     4-bit, scale ``d * sc``, min ``-dmin * m``
Q5_0      32 weights, fp16 ``d``, 5 bits: ``d (q - 16)``  8-bit codes -16..15, scale ``d``
Q5_1      32 weights, fp16 ``d``, ``m``, 5 bits           8-bit codes 0..31, scale ``d``, min ``m``
Q5_K      as Q4_K with a fifth bit per weight             8-bit codes 0..31, scale and min as Q4_K
Q6_K      16 groups of 16 in 256, int8 scales, 6 bits     8-bit codes -32..31, scale ``d * sc``
Q3_K      16 groups of 16 in 256, 6-bit scales, 3 bits    8-bit codes -4..3, scale ``d * (sc - 32)``
Q2_K      16 groups of 16 in 256, 4-bit scales/mins, 2 b  8-bit codes 0..3, scale ``d * sc``, min ``-dmin * m``
Q8_0      32 int8 weights, fp16 ``d``                     8-bit, scale ``d``
IQ4_NL    32 weights, fp16 ``d``, 4-bit table indices      8-bit codes: the table's int8 values, scale ``d``
IQ4_XS    8 groups of 32 in 256, 6-bit scales, as IQ4_NL  8-bit table values, scale ``d * (ls - 32)``
========  =============================================  ==========================================

Every scale and min is an fp16 times a small integer, exact in fp32, and ``code * scale`` (+ ``min``) rounded
once (one multiply or fused multiply-add in the kernel) is what the ``gguf`` package's ``dequantize`` computes
too, so the kept weights are its values bit for bit: tests/unit/test_gguf_blocks.py checks this per type. The
5-, 6-, 3- and 2-bit types and the IQ4 ones take a byte per weight here (1.05-1.25 bytes with the scales, against
0.33-0.82 in the file): the one kernel layout for them is a byte, which keeps the kernel to five block formats.

The layout (``csrc/quant_linear.h`` says why): output rows in tiles of the kernels' panel width W; per tile and
group, W fp32 scales, W fp32 mins (when the format has one), then for each input of the group the W rows'
codes (4-bit: byte i holds row i low and row i + W/2 high). A :class:`QuantizedWeight` is one or more such
parts stacked along the output rows, described by ``meta [P, 9]`` int64: (byte offset, rows, K, bits, group,
has_min, first output row, W, layout).

Layout 2 (the K-quants and IQ4_XS, whose every scale and min is the super-block's fp16 ``d`` or ``dmin`` times
a small integer) keeps those integers instead of the fp32 products: per tile and super-block of 256 inputs, W fp16
units (``d``, then ``-dmin``), then every group's multipliers (W int8 per field; for groups of 32 with a min, Q4_K's
and Q5_K's, six bits each, as the file keeps them: :func:`packed_multipliers`), then every group's codes as in layout
0. The kernel multiplies unit by multiplier (exact in fp32: an fp16 times at most 8 bits), so the weights are the
same values bit for bit: Q4_K in its file's 4.5 bits a weight instead of 6, Q6_K's scales in its file's bytes too.
:func:`factored` checks each tensor's products are exact before it takes this layout, else it keeps layout 0.

Flag 16 on layouts 0, 1, 3, 6, 8 and 10 (:data:`LAYOUT_FP16_HEAD`) keeps a group's scales and mins in fp16
instead of fp32: the formats without super-blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) hold each as an fp16 in
the file, so with the flag they read the file's bytes too (Q4_1: 20 bytes a group of 32 against 24).
:func:`fp16_head` checks every value is one (Q4_0's min is ``-8 d``, exact unless it overflows).

Layout 1 (``int8_activations``, 4-bit parts only) keeps the same scales, mins and codes in another order, for
the kernel that rounds the activations to 8 bits (per group of 32, or per super-block of 256 in front of a K-quant's
factored layout) and multiplies with integer dot products
(llama.cpp's arithmetic for these types): each group's codes in 8 quads of 4 inputs, byte j of a quad holding
row j // 4 (low nibble) and row W/2 + j // 4 (high) at input j % 4 of the quad. The weights are the same fp32
values (``dequantize`` reads both layouts); only the activations are rounded.

Layout 5 (``int8_activations``, a K-quant's 4-bit parts: Q4_K) is layout 1's quads with layout 2's units and
multipliers: the file's 4.5 bits a weight for the 8-bit-activation kernel too.

Layouts 3 and 4 (``int8_activations``, the 8-bit formats whose codes lie in -32..31: Q6_K, Q5_0, Q5_1, Q5_K, Q3_K,
Q2_K) are layout 0 and layout 2 with each group's codes reordered for the same kernel: in quads of 4 inputs, byte
4c + j of a quad holding row c's code at input j plus :data:`BYTE_QUAD_BIAS` (0..63, an unsigned byte for the
integer dot product; the kernel takes 32 times the activations' sum back). Same bytes, same weights.

Flag 32 on layouts 6 to 9 (:data:`LAYOUT_EXACT_QUADS`) keeps those narrow quads for the exact path: the kernel
converts each quad's codes to fp32 for the four inputs at once and multiplies them by the fp32 activations, the
same weights bit for bit as layouts 0 and 2, in the file's bits (what :meth:`QuantizedWeight.from_groups` writes
without ``int8_activations`` for the formats whose codes fit six or five bits).

Flag 64 on the factored quad layouts (4, 5, 7 and 9: the K-quants under ``int8_activations``;
:data:`LAYOUT_GROUP_ACTS`) changes how the kernel rounds their activations, not the bytes: per group of 32 inputs, as
the formats without super-blocks take them, instead of one scale per super-block of 256 inputs (llama.cpp's Q8_K).

Layouts 6 and 7 are layouts 3 and 4 in six bits a code (every biased code is 0..63): per quad a plane of low
nibbles and a plane of top bit pairs (:func:`_six_bit_quads`), 3 bytes per 4 codes: Q6_K in its file's 6.5625 bits
a weight (layout 7) instead of 8.6, which is what a decode step reads of it. Layouts 8 and 9 are the same in five
bits a code, for the formats whose codes fit (Q5_0, Q5_1, Q5_K, Q3_K, Q2_K; biased by :func:`five_bit_bias`
instead): the plane of low nibbles and a plane of fifth bits (:func:`_five_bit_quads`), 5 bytes per 8 codes, so Q5_0
and Q5_1 (with an fp16 head) and Q5_K read their file's 5.5, 6 and 5.5 bits a weight. For ``int8_activations`` the
loader writes the narrowest: five bits where the codes fit, else six.

Layout 10 (``int8_activations``, the 8-bit groups of 32 without a min whose codes span -128..127: Q8_0, IQ4_NL,
IQ4_XS) is layout 3 with the codes biased by :data:`WIDE_BYTE_QUAD_BIAS` instead ("wide" byte quads): vpdpbusd
multiplies the stored bytes as they are and takes 128 times the activations' sum back; AVX2, whose ``vpmaddubsw``
would saturate on such pairs, multiplies each code's magnitude by the activation given the code's sign (llama.cpp's
way for Q8_0). With the fp16 head, Q8_0 in its file's 8.5 bits a weight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

QK_K = 256  # weights per K-quant super-block
LAYOUT_INPUTS, LAYOUT_QUADS, LAYOUT_FACTORED = 0, 1, 2  # meta column 8
LAYOUT_BYTE_QUADS, LAYOUT_BYTE_QUADS_FACTORED = 3, 4  # 8-bit codes in quads: layout 0's, layout 2's
LAYOUT_QUADS_FACTORED = 5  # 4-bit codes in quads (layout 1's) with layout 2's units and multipliers
LAYOUT_SIX_BIT_QUADS, LAYOUT_SIX_BIT_QUADS_FACTORED = 6, 7  # layouts 3 and 4 in six bits a code
LAYOUT_FIVE_BIT_QUADS, LAYOUT_FIVE_BIT_QUADS_FACTORED = 8, 9  # layouts 3 and 4 in five bits a code
LAYOUT_WIDE_BYTE_QUADS = 10  # layout 3 for codes across all of -128..127 (Q8_0, IQ4_NL, IQ4_XS)
INT8_ACTIVATION_LAYOUTS = (
    LAYOUT_QUADS,
    LAYOUT_BYTE_QUADS,
    LAYOUT_BYTE_QUADS_FACTORED,
    LAYOUT_QUADS_FACTORED,
    LAYOUT_SIX_BIT_QUADS,
    LAYOUT_SIX_BIT_QUADS_FACTORED,
    LAYOUT_FIVE_BIT_QUADS,
    LAYOUT_FIVE_BIT_QUADS_FACTORED,
    LAYOUT_WIDE_BYTE_QUADS,
)
_FACTORED_LAYOUTS = (
    LAYOUT_FACTORED,
    LAYOUT_BYTE_QUADS_FACTORED,
    LAYOUT_QUADS_FACTORED,
    LAYOUT_SIX_BIT_QUADS_FACTORED,
    LAYOUT_FIVE_BIT_QUADS_FACTORED,
)
_SIX_BIT_LAYOUTS = (LAYOUT_SIX_BIT_QUADS, LAYOUT_SIX_BIT_QUADS_FACTORED)
_FIVE_BIT_LAYOUTS = (LAYOUT_FIVE_BIT_QUADS, LAYOUT_FIVE_BIT_QUADS_FACTORED)
_BYTE_QUAD_LAYOUTS = (
    LAYOUT_BYTE_QUADS,
    LAYOUT_BYTE_QUADS_FACTORED,
    *_SIX_BIT_LAYOUTS,
    *_FIVE_BIT_LAYOUTS,
    LAYOUT_WIDE_BYTE_QUADS,
)
# A flag on layouts 0, 1, 3, 6, 8 and 10 (groups of 32): each group's scales and mins in fp16, not fp32 (the formats
# without super-blocks keep them in fp16 in the file; an fp16 head reads the file's bytes)
LAYOUT_FP16_HEAD = 16
_FP16_HEAD_LAYOUTS = (
    LAYOUT_INPUTS,
    LAYOUT_QUADS,
    LAYOUT_BYTE_QUADS,
    LAYOUT_SIX_BIT_QUADS,
    LAYOUT_FIVE_BIT_QUADS,
    LAYOUT_WIDE_BYTE_QUADS,
)
# A flag on the narrow byte-quad layouts (6 to 9): the same bytes multiplied by fp32 activations (the exact path)
LAYOUT_EXACT_QUADS = 32
# A flag on the factored quad layouts (4, 5, 7, 9): their activations rounded per group of 32, not per super-block
LAYOUT_GROUP_ACTS = 64
_GROUP_ACTS_LAYOUTS = tuple(x for x in _FACTORED_LAYOUTS if x in INT8_ACTIVATION_LAYOUTS)
_SAME_PATH_FLAGS = LAYOUT_FP16_HEAD | LAYOUT_GROUP_ACTS  # flags that leave a layout on its path
_EXACT_QUAD_LAYOUTS = (*_SIX_BIT_LAYOUTS, *_FIVE_BIT_LAYOUTS)
BYTE_QUAD_BIAS = 32  # added to the codes (-32..31) of byte quads: vpdpbusd multiplies unsigned bytes
WIDE_BYTE_QUAD_BIAS = 128  # added to the codes (-128..127) of wide byte quads (layout 10)


def five_bit_bias(fmt: BlockFormat) -> int:
    """What five-bit quads add to a format's codes: 16 to signed ones (no min: Q5_0's -16..15, Q3_K's -4..3), 0 to
    unsigned ones (a min: Q5_1's, Q5_K's 0..31, Q2_K's 0..3)."""
    return 0 if fmt.has_min else 16


def _byte_quads(codes: np.ndarray, bias: int = BYTE_QUAD_BIAS) -> np.ndarray:
    """Codes ``[T, G, group, W]`` (int8 values as bytes, -32..31, or any with ``bias`` 128) -> bytes
    ``[T, G, group / 4, W, 4]``: quad u's byte 4c + j is row c's code at input 4u + j, plus ``bias``."""
    t, g, group, w = codes.shape
    quads = codes.reshape(t, g, group // 4, 4, w).transpose(0, 1, 2, 4, 3)  # [T, G, quad, W, input]
    return (quads.view(np.int8).astype(np.int16) + bias).astype(np.uint8)


def _five_bit_quads(quads: np.ndarray, bias: int) -> np.ndarray:
    """Byte quads ``[T, G, quads, W, 4]`` -> five-bit quads ``[T, G, quads, 5 W / 2]``, the codes biased by ``bias``
    instead of :data:`BYTE_QUAD_BIAS` (0..31): the plane of low nibbles as :func:`_six_bit_quads` keeps it, then a plane
    of fifth bits, ``W / 2`` bytes, byte j: bit c the first vector's byte j + c W / 2, bit 4 + c the second's (c < 4),
    as ``simd::narrow_quad`` reads them."""
    t, g, num_quads, w, _ = quads.shape
    b = (quads.astype(np.int16) - BYTE_QUAD_BIAS + bias).astype(np.uint8).reshape(t, g, num_quads, 4 * w)
    first, second = b[..., : 2 * w], b[..., 2 * w :]
    low = (first & 15) | ((second & 15) << 4)
    chunks = [(v >> 4).reshape(t, g, num_quads, 4, w // 2) for v in (first, second)]  # [.., c, W / 2] each
    shifts = np.arange(4, dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    high = np.bitwise_or.reduce((chunks[0] << shifts) | (chunks[1] << (shifts + 4)), axis=3)
    return np.concatenate([low, high], axis=-1).astype(np.uint8)


def _quad_codes(codes: np.ndarray, layout: int, fmt: BlockFormat) -> np.ndarray:
    """Codes ``[T, G, group, W]`` -> a byte-quad layout's code bytes (3 and 4: a byte, 6 and 7: six bits, 8 and 9:
    five bits a code, 10: a byte biased by :data:`WIDE_BYTE_QUAD_BIAS`)."""
    if layout == LAYOUT_WIDE_BYTE_QUADS:
        return _byte_quads(codes, WIDE_BYTE_QUAD_BIAS)
    quads = _byte_quads(codes)
    if layout in _SIX_BIT_LAYOUTS:
        return _six_bit_quads(quads)
    if layout in _FIVE_BIT_LAYOUTS:
        return _five_bit_quads(quads, five_bit_bias(fmt))
    return quads


def _six_bit_quads(quads: np.ndarray) -> np.ndarray:
    """Byte quads ``[T, G, quads, W, 4]`` (codes 0..63) -> six-bit quads ``[T, G, quads, 3 W]``: per quad its two
    kernel vectors' bytes (``2 W`` each: rows below W / 2, then the rest) as a plane of low nibbles (byte i: the
    first vector's byte i low, the second's high) and a plane of top bit pairs (byte j: bits 0-1 the first's byte
    j, 2-3 its byte j + W, 4-5 the second's byte j, 6-7 its byte j + W), as ``simd::narrow_quad`` reads them."""
    t, g, num_quads, w, _ = quads.shape
    b = quads.reshape(t, g, num_quads, 4 * w)
    first, second = b[..., : 2 * w], b[..., 2 * w :]
    low = (first & 15) | ((second & 15) << 4)
    h0, h1 = first >> 4, second >> 4
    high = h0[..., :w] | (h0[..., w:] << 2) | (h1[..., :w] << 4) | (h1[..., w:] << 6)
    return np.concatenate([low, high], axis=-1).astype(np.uint8)


def fp16_head(groups: Groups) -> bool:
    """Whether every scale and min of ``groups`` (groups of 32) is an fp16 value, so the head can hold them in fp16."""
    if groups.fmt.group != 32:
        return False
    with np.errstate(over="ignore"):
        return all(
            np.array_equal(f.astype(np.float16).astype(np.float32), f)  # an inf or NaN never compares equal
            for f in (groups.scale, groups.min)
            if f is not None
        )


def takes_five_bits(groups: Groups) -> bool:
    """Whether a byte-quad part's codes fit five bits with :func:`five_bit_bias`: Q5_0, Q5_1, Q5_K, Q3_K, Q2_K (not
    Q6_K)."""
    if not takes_byte_quads(groups):
        return False
    codes = groups.codes.view(np.int8).astype(np.int16) + five_bit_bias(groups.fmt)
    return codes.size == 0 or (int(codes.min()) >= 0 and int(codes.max()) < 32)


def takes_wide_byte_quads(groups: Groups) -> bool:
    """Whether an 8-bit part whose codes do not fit byte quads can be multiplied by 8-bit activations as wide byte
    quads (layout 10: Q8_0, IQ4_NL, IQ4_XS): groups of 32 without a min."""
    return groups.fmt == BlockFormat(8, 32, False)


def takes_byte_quads(groups: Groups) -> bool:
    """Whether an 8-bit part can be multiplied by 8-bit activations as byte quads: codes within -32..31 (Q6_K,
    Q5_0, Q5_1, Q5_K, Q3_K, Q2_K; not Q8_0 or the IQ4 table values) and K a multiple of 32."""
    codes = groups.codes.view(np.int8)  # the 8-bit formats' codes are int8 values as bytes
    return (
        groups.fmt.bits == 8
        and codes.shape[1] * groups.fmt.group % 32 == 0
        and (codes.size == 0 or (int(codes.min()) >= -BYTE_QUAD_BIAS and int(codes.max()) < BYTE_QUAD_BIAS))
    )


class BlockFormat(NamedTuple):
    bits: int
    group: int
    has_min: bool


FORMATS: dict[str, BlockFormat] = {
    "Q4_0": BlockFormat(4, 32, True),
    "Q4_1": BlockFormat(4, 32, True),
    "Q4_K": BlockFormat(4, 32, True),
    "Q5_0": BlockFormat(8, 32, False),
    "Q5_1": BlockFormat(8, 32, True),
    "Q5_K": BlockFormat(8, 32, True),
    "Q6_K": BlockFormat(8, 16, False),
    "Q8_0": BlockFormat(8, 32, False),
    "Q2_K": BlockFormat(8, 16, True),
    "Q3_K": BlockFormat(8, 16, False),
    "IQ4_NL": BlockFormat(8, 32, False),
    "IQ4_XS": BlockFormat(8, 32, False),
}
# IQ4_NL / IQ4_XS: each 4-bit code indexes this table of int8 values (ggml's kvalues_iq4nl)
IQ4_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8
)
QUANTIZED_TYPES = tuple(FORMATS)


class Groups(NamedTuple):
    """One tensor's groups: ``codes [rows, G, group]`` uint8, one per weight (0..15 for 4 bits; int8 values as
    their bytes for 8), ``scale`` and ``min`` ``[rows, G]`` float32 (``min`` None when the format has none).

    A K-quant's scales (and mins) are a super-block's fp16 ``d`` (``dmin``) times a small integer per group:
    ``scale_unit`` (``min_unit``) ``[rows, G * group / 256]`` float32 holds that fp16 value per super-block of
    256 inputs (negated for the mins), so that every scale is ``unit * integer`` exactly (the factored layout);
    None for the types with a free fp16 per group."""

    fmt: BlockFormat
    codes: np.ndarray
    scale: np.ndarray
    min: np.ndarray | None
    scale_unit: np.ndarray | None = None
    min_unit: np.ndarray | None = None

    def take_rows(self, order: np.ndarray) -> Groups:
        def rows(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[order]

        return Groups(
            self.fmt,
            self.codes[order],
            self.scale[order],
            rows(self.min),
            rows(self.scale_unit),
            rows(self.min_unit),
        )


def _f16(raw: np.ndarray) -> np.ndarray:
    """``[..., 2]`` uint8 -> ``[...]`` float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """``[..., 16]`` bytes holding code j low and code j + 16 high -> ``[..., 32]`` codes."""
    return np.concatenate([packed & 15, packed >> 4], axis=-1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes per super-block -> 8 six-bit scales and 8 six-bit mins (``[n, 8]`` each).

    Bytes 0-3 hold the low 6 bits of scales 0-3 (top 2 bits: high bits of scales 4-7), bytes 4-7 the same for
    the mins, bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble).
    """
    s = scales.reshape(-1, 3, 4)
    a, b, c = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def to_groups(type_name: str, raw: np.ndarray, in_features: int) -> Groups:
    """A GGUF tensor's bytes ``[rows, bytes_per_row]`` (``gguf.ReaderTensor.data``) -> its :class:`Groups`."""
    if type_name not in FORMATS:
        raise ValueError(
            f"no quantized kernel for GGUF type {type_name} (kept: {', '.join(QUANTIZED_TYPES)})"
        )
    fmt = FORMATS[type_name]
    rows = raw.shape[0]
    num_groups = in_features // fmt.group
    if in_features % fmt.group:
        raise ValueError(f"{type_name} rows of {in_features} weights are not whole groups of {fmt.group}")
    if type_name in ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "IQ4_NL"):
        return _small_block_groups(type_name, fmt, raw.reshape(rows, num_groups, -1))
    num_super = in_features // QK_K
    if in_features % QK_K:
        raise ValueError(f"{type_name} rows of {in_features} weights are not whole super-blocks of {QK_K}")
    sb = raw.reshape(rows * num_super, -1)  # [n, super-block bytes]
    codes, scale, minimum, d, dmin = _K_QUANTS[type_name](sb)
    return Groups(
        fmt,
        codes.reshape(rows, num_groups, fmt.group),
        scale.reshape(rows, num_groups),
        None if minimum is None else minimum.reshape(rows, num_groups),
        d.reshape(rows, num_super),
        None if dmin is None else (-dmin).reshape(rows, num_super),
    )


def _q4_k_q5_k(sb: np.ndarray, five_bits: bool) -> _KParts:
    """Q4_K's or Q5_K's super-blocks: fp16 d and dmin, twelve bytes of 6-bit scales and mins, (Q5_K: a fifth bit
    per code,) four bits a code."""
    n = sb.shape[0]
    d, dmin = _f16(sb[:, 0:2])[:, None], _f16(sb[:, 2:4])[:, None]
    sc, mn = _k_scale_min(sb[:, 4:16])
    scale, minimum = d * sc, -(dmin * mn)  # [n, 8]
    nibbles = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    if not five_bits:
        qs = sb[:, 16:144].reshape(n, 4, 1, 32) >> nibbles
        return (
            (qs & 15).reshape(n, 8, 32),
            scale,
            minimum,
            d,
            dmin,
        )  # group 2c: bytes 32c..'s low nibbles, 2c+1 high
    qh = sb[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)  # bit s: group s
    qs = sb[:, 48:176].reshape(n, 4, 1, 32) >> nibbles
    return ((qs & 15).reshape(n, 8, 32) | ((qh & 1) << 4)).astype(np.uint8), scale, minimum, d, dmin


def _q6_k(sb: np.ndarray) -> _KParts:
    """Q6_K's super-blocks: ql [128], qh [64], int8 scales [16], fp16 d."""
    n = sb.shape[0]
    ql = sb[:, 0:128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qh = sb[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = ((ql & 15).reshape(n, 8, 32) | ((qh & 3).reshape(n, 8, 32) << 4)).astype(np.int16) - 32
    scales = np.ascontiguousarray(sb[:, 192:208]).view(np.int8).astype(np.float32)  # [n, 16]
    d = _f16(sb[:, 208:210])[:, None]
    return q.astype(np.int8).view(np.uint8), d * scales, None, d, None


def group_values(groups: Groups) -> np.ndarray:
    """The fp32 weights ``[rows, K]`` of :class:`Groups`: ``code * scale + min`` rounded once to fp32, as the
    kernels' fused multiply-add rounds it."""
    codes = groups.codes if groups.fmt.bits == 4 else groups.codes.view(np.int8)  # 8-bit codes: int8 bytes
    values = codes.astype(np.float64) * groups.scale[..., None]  # exact: an fp32 times a small integer
    if groups.min is not None:
        values += groups.min[..., None]
    return values.astype(np.float32).reshape(codes.shape[0], -1)


Q4_WITH_MIN = BlockFormat(4, 32, True)


def _round_4bit(values: np.ndarray, scale: np.ndarray, low: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The nearest codes 0..15 of ``values [..., 32]`` for ``scale``, ``low [...]``, and each group's squared error."""
    inverse = np.divide(1, scale, out=np.zeros_like(scale), where=scale > 0)
    codes = np.clip(np.rint((values - low[..., None]) * inverse[..., None]), 0, 15)
    error = ((codes * scale[..., None] + low[..., None] - values) ** 2).sum(axis=-1)
    return codes, error


def requantize_4bit(groups: Groups, num_refinements: int = 3) -> Groups:
    """Any format as 4-bit codes with an fp32 scale and min per group of 32 (Q4_1's arithmetic): an approximation,
    for ``"gguf-q4"`` (a speculative draft, whose tokens the target verifies, needs no exact weights, only fewer
    bytes a token). 4-bit groups of 32 with a min are kept as they are.

    Min-max rounding first (each weight within half a step, range / 30, of its value), then ``num_refinements``
    rounds of least squares: the scale and min that fit the codes best, the codes re-rounded for them, a group's
    new fit kept only where its squared error went down (so never worse than min-max; llama.cpp's quantizers
    search their scales too)."""
    if groups.fmt == Q4_WITH_MIN:
        return groups
    values = group_values(groups).astype(np.float64)
    rows = values.shape[0]
    values = values.reshape(rows, -1, Q4_WITH_MIN.group)  # [rows, G32, 32]
    low, high = values.min(axis=-1), values.max(axis=-1)
    scale = (high - low) / 15
    codes, error = _round_4bit(values, scale, low)
    n = Q4_WITH_MIN.group
    for _ in range(num_refinements):
        sum_c, sum_cc = codes.sum(axis=-1), (codes * codes).sum(axis=-1)
        sum_w, sum_cw = values.sum(axis=-1), (codes * values).sum(axis=-1)
        det = n * sum_cc - sum_c * sum_c
        fit = det > 0
        new_scale = np.where(fit, (n * sum_cw - sum_c * sum_w) / np.where(fit, det, 1), scale)
        new_low = np.where(fit, (sum_w - new_scale * sum_c) / n, low)
        # rounded to the fp32 the kernel holds before the codes are chosen for them
        new_scale, new_low = new_scale.astype(np.float32).astype(np.float64), new_low.astype(np.float32)
        new_codes, new_error = _round_4bit(values, new_scale, new_low.astype(np.float64))
        better = (new_error < error) & (new_scale > 0)
        scale, low = np.where(better, new_scale, scale), np.where(better, new_low, low)
        codes, error = np.where(better[..., None], new_codes, codes), np.where(better, new_error, error)
    return Groups(Q4_WITH_MIN, codes.astype(np.uint8), scale.astype(np.float32), low.astype(np.float32))


def _as_bytes(codes: np.ndarray) -> np.ndarray:
    """Signed codes -> their int8 bytes, as the 8-bit formats store them."""
    return np.ascontiguousarray(codes.astype(np.int8)).view(np.uint8)


def _five_bits(block: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: ``qh`` (4 bytes: bit j the fifth bit of weight j) then 16 bytes of nibbles -> codes 0..31."""
    qh = np.ascontiguousarray(block[..., :4]).view(np.uint32)  # [rows, G, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [rows, G, 32]
    return _nibbles(block[..., 4:]) | (high << 4)


def _small_block_groups(type_name: str, fmt: BlockFormat, block: np.ndarray) -> Groups:
    """Types of one fp16 ``d`` (and ``m``) per 32 weights; ``block`` [rows, G, block bytes]."""
    d = _f16(block[..., 0:2])
    if type_name == "Q8_0":
        return Groups(fmt, np.ascontiguousarray(block[..., 2:]), d, None)
    if type_name == "Q4_0":  # d * (q - 8)
        return Groups(fmt, _nibbles(block[..., 2:]), d, d * np.float32(-8))
    if type_name == "Q4_1":  # d * q + m
        return Groups(fmt, _nibbles(block[..., 4:]), d, _f16(block[..., 2:4]))
    if type_name == "Q5_0":  # d * (q - 16): signed codes, no min (the product is exact either way)
        return Groups(fmt, _as_bytes(_five_bits(block[..., 2:]).astype(np.int16) - 16), d, None)
    if type_name == "Q5_1":  # d * q + m
        return Groups(fmt, _five_bits(block[..., 4:]), d, _f16(block[..., 2:4]))
    # IQ4_NL: d * table[q]
    return Groups(fmt, _as_bytes(IQ4_VALUES[_nibbles(block[..., 2:])]), d, None)


_KParts = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray, np.ndarray | None]
# codes, scales, mins (or None), and the super-block's fp16 d and dmin (or None) as float32 [n, 1]


def _q2_k(sb: np.ndarray) -> _KParts:
    """Q2_K (84 bytes: 16 scale/min bytes, 64 of 2-bit codes, fp16 d, dmin): d * sc * q - dmin * m per 16."""
    n = sb.shape[0]
    sc = sb[:, 0:16]
    qs = (sb[:, 16:80].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    d, dmin = _f16(sb[:, 80:82])[:, None], _f16(sb[:, 82:84])[:, None]
    scale = d * (sc & 15).astype(np.float32)
    minimum = -(dmin * (sc >> 4).astype(np.float32))
    return np.ascontiguousarray(qs.reshape(n, 16, 16)), scale, minimum, d, dmin


def _q3_k(sb: np.ndarray) -> _KParts:
    """Q3_K (110 bytes: 32 of high-bit mask, 64 of 2-bit codes, 12 of 6-bit scales, fp16 d): d * (sc - 32) * q
    per 16, q = low 2 bits - 4 where the mask bit is 0 (-4..3)."""
    n = sb.shape[0]
    hmask, qs, packed = sb[:, 0:32], sb[:, 32:96], sb[:, 96:108]
    d = _f16(sb[:, 108:110])
    low = (packed[:, 0:8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(
        n, 16
    )
    high = packed[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)
    sc = ((low & 15) | ((high.reshape(n, 16) & 3) << 4)).astype(np.int16) - 32
    ql = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    qh = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = ql.reshape(n, 16, 16).astype(np.int16) - ((qh.reshape(n, 16, 16) ^ 1).astype(np.int16) << 2)
    return _as_bytes(q), d[:, None] * sc.astype(np.float32), None, d[:, None], None


def _iq4_xs(sb: np.ndarray) -> _KParts:
    """IQ4_XS (136 bytes: fp16 d, 2 bytes of high scale bits, 4 of low, 128 of nibbles): d * (ls - 32) *
    table[q] per 32."""
    n = sb.shape[0]
    d = _f16(sb[:, 0:2])
    high = np.ascontiguousarray(sb[:, 2:4]).view(np.uint16)  # [n, 1]
    high = ((high >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8)  # [n, 8]
    low = (sb[:, 4:8].reshape(n, 4, 1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2)).reshape(
        n, 8
    ) & 15
    ls = (low | (high << 4)).astype(np.int16) - 32
    q = _nibbles(sb[:, 8:136].reshape(n, 8, 16))  # [n, 8, 32]
    return _as_bytes(IQ4_VALUES[q]), d[:, None] * ls.astype(np.float32), None, d[:, None], None


_K_QUANTS: dict[str, Callable[[np.ndarray], _KParts]] = {
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "IQ4_XS": _iq4_xs,
    "Q4_K": lambda sb: _q4_k_q5_k(sb, five_bits=False),
    "Q5_K": lambda sb: _q4_k_q5_k(sb, five_bits=True),
    "Q6_K": _q6_k,
}


def pack_groups(groups: Groups, tile_rows: int, layout: int = LAYOUT_INPUTS) -> np.ndarray:
    """:class:`Groups` -> the tile layout's bytes (rows padded to whole tiles of ``tile_rows`` with zeros)."""
    fmt, rows, num_groups = groups.fmt, groups.codes.shape[0], groups.codes.shape[1]
    padded = -(-rows // tile_rows) * tile_rows
    num_tiles = padded // tile_rows

    def tiles(a: np.ndarray) -> np.ndarray:  # [rows, ...] -> [tiles, tile_rows, ...], zero rows appended
        if padded != rows:
            a = np.concatenate([a, np.zeros((padded - rows, *a.shape[1:]), a.dtype)])
        return a.reshape(num_tiles, tile_rows, *a.shape[1:])

    half = tile_rows // 2
    head_dtype = np.float32
    if layout & LAYOUT_EXACT_QUADS:
        layout &= ~LAYOUT_EXACT_QUADS
        if layout & ~LAYOUT_FP16_HEAD not in _EXACT_QUAD_LAYOUTS:
            raise ValueError(f"the exact path's quads take layouts 6 to 9, not layout {layout}")
    if layout & LAYOUT_FP16_HEAD:
        layout &= ~LAYOUT_FP16_HEAD
        if layout not in _FP16_HEAD_LAYOUTS or not fp16_head(groups):
            raise ValueError(
                f"an fp16 head takes layouts 0, 1, 3, 6, 8 and 10 and fp16 scales, not layout {layout}"
            )
        head_dtype = np.float16
    if layout == LAYOUT_WIDE_BYTE_QUADS and not takes_wide_byte_quads(groups):
        raise ValueError(f"wide byte quads take 8-bit groups of 32 without a min, not {fmt}")
    if layout in _BYTE_QUAD_LAYOUTS and layout != LAYOUT_WIDE_BYTE_QUADS and not takes_byte_quads(groups):
        raise ValueError(f"byte quads take 8-bit codes in -32..31 and K a multiple of 32, not {fmt}")
    if layout in _FIVE_BIT_LAYOUTS and not takes_five_bits(groups):
        raise ValueError(
            f"five-bit quads take codes 0..31 once biased by {five_bit_bias(fmt)}, not these {fmt}"
        )
    if layout in (LAYOUT_QUADS, LAYOUT_QUADS_FACTORED) and fmt != BlockFormat(4, 32, True):
        raise ValueError(f"the quad layout takes 4-bit groups of 32 with a min, not {fmt}")
    if layout in _FACTORED_LAYOUTS:
        return _pack_factored(groups, tiles, num_tiles, layout)
    fields = [tiles(groups.scale.astype(head_dtype)).transpose(0, 2, 1)]  # [tiles, G, tile_rows]
    if fmt.has_min:
        assert groups.min is not None
        fields.append(tiles(groups.min.astype(head_dtype)).transpose(0, 2, 1))
    heads = [np.ascontiguousarray(f).view(np.uint8) for f in fields]  # [tiles, G, 4 or 2 * tile_rows] each
    if layout == LAYOUT_QUADS:
        codes = _nibble_quads(tiles(groups.codes))
        return np.concatenate([*heads, codes], axis=-1).reshape(-1)
    codes = tiles(groups.codes).transpose(0, 2, 3, 1)  # [tiles, G, group, tile_rows]: the rows of one input
    if layout in _BYTE_QUAD_LAYOUTS:
        codes = _quad_codes(codes, layout, fmt)
    elif fmt.bits == 4:
        codes = codes[..., :half] | (codes[..., half:] << 4)  # byte i: row i low, row i + half high
    codes = np.ascontiguousarray(codes).view(np.uint8).reshape(num_tiles, num_groups, -1)
    return np.concatenate([*heads, codes], axis=-1).reshape(-1)  # [tiles, G, group bytes]


def _nibble_quads(codes: np.ndarray) -> np.ndarray:
    """4-bit codes ``[T, W, G, 32]`` -> the quad layout's bytes ``[T, G, 16 W]``: per group 8 quads of 4 inputs,
    byte 4r + i of a quad holding row r (low nibble) and row r + W/2 (high) at input i."""
    t, w, g = codes.shape[:3]
    quads = codes.reshape(t, w, g, 8, 4).transpose(0, 2, 3, 1, 4)  # [T, G, quad, W, 4]
    packed = quads[:, :, :, : w // 2] | (quads[:, :, :, w // 2 :] << 4)
    return np.ascontiguousarray(packed).reshape(t, g, -1)


def _multipliers(values: np.ndarray, unit: np.ndarray, per_super: int) -> np.ndarray | None:
    """``values [rows, G]`` as ``unit [rows, G / per_super]`` (repeated per group) times int8 multipliers, or None
    where some value is not exactly such a product."""
    units = np.repeat(unit, per_super, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        mult = np.where(units != 0, np.rint(values / units), 0)
    if mult.size and (mult.min() < -128 or mult.max() > 127):  # NaN compares False: caught below
        return None
    mult = mult.astype(np.int8)
    if not np.array_equal(units * mult.astype(np.float32), values):  # NaNs never compare equal: refused too
        return None
    return mult


def packed_multipliers(fmt: BlockFormat) -> bool:
    """Whether the factored layouts keep this format's multipliers in six bits each (groups of 32 with a min: Q4_K's
    and Q5_K's 6-bit scales and mins) rather than a byte."""
    return fmt.has_min and fmt.group == 32


def factored(groups: Groups) -> bool:
    """Whether ``groups`` can take the factored layout (a K-quant whose every scale and min is its unit, an fp16,
    times an int8, exactly; six bits, 0..63, where :func:`packed_multipliers`)."""
    return _factors(groups) is not None


def _factors(groups: Groups) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """[(unit [rows, S] fp16, multipliers [rows, G] int8)] for the scales (and the mins), or None."""
    num_groups = groups.codes.shape[1]
    per_super = QK_K // groups.fmt.group
    if (
        groups.scale_unit is None
        or num_groups % per_super
        or groups.scale_unit.shape[1] * per_super != num_groups
    ):
        return None
    pairs = [(groups.scale, groups.scale_unit)]
    if groups.fmt.has_min:
        if groups.min is None or groups.min_unit is None:
            return None
        pairs.append((groups.min, groups.min_unit))
    out = []
    for values, unit in pairs:
        unit32 = unit.astype(np.float32)
        with np.errstate(over="ignore"):
            unit16 = unit32.astype(np.float16)
        if not np.array_equal(unit16.astype(np.float32), unit32):  # kept as fp16: it must be one
            return None
        mult = _multipliers(values.astype(np.float32), unit32, per_super)
        if mult is None or (
            packed_multipliers(groups.fmt) and mult.size and (mult.min() < 0 or mult.max() > 63)
        ):
            return None
        out.append((unit16, mult))
    return out


def _six_bit_pairs(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Multipliers 0..63 ``[T, G, W]`` each -> ``[T, G, 3 W / 2]`` bytes as ``simd::six_bit_pairs`` reads them: byte
    r the low nibbles (scale | min << 4), then byte i of W / 2 the top bit pairs of scale i, min i, scale i + W / 2,
    min i + W / 2."""
    s, m = scales.astype(np.uint8), mins.astype(np.uint8)
    half = s.shape[-1] // 2
    nib = (s & 15) | ((m & 15) << 4)
    top = (s >> 4) | ((m >> 4) << 2)  # 4 bits a row
    return np.concatenate([nib, top[..., :half] | (top[..., half:] << 4)], axis=-1).astype(np.uint8)


def _pack_factored(  # type: ignore[no-untyped-def]
    groups: Groups, tiles, num_tiles: int, layout: int = LAYOUT_FACTORED
) -> np.ndarray:
    """Layout 2: per tile and super-block of 256 inputs, the tile rows' fp16 units (scale, then min), then per group
    the rows' multipliers (int8 per field, or six-bit pairs: :func:`packed_multipliers`), then per group its codes
    as layout 0 stores them (layout 4: as layout 3 stores them; layout 5: as layout 1; layout 7: as layout 6; layout
    9: as layout 8)."""
    pairs = _factors(groups)
    if pairs is None:
        raise ValueError("these groups' scales are not an fp16 unit per super-block times int8 multipliers")
    fmt, num_groups = groups.fmt, groups.codes.shape[1]
    per_super = QK_K // fmt.group
    num_super = num_groups // per_super
    width = tiles(groups.scale).shape[1]
    units = [tiles(u).transpose(0, 2, 1) for u, _ in pairs]  # [T, S, W] float16 each
    supers = np.concatenate(
        [np.ascontiguousarray(u).view(np.uint8) for u in units], axis=-1
    )  # [T, S, 2W per field]
    mults = [tiles(m).transpose(0, 2, 1) for _, m in pairs]  # [T, G, W] int8 each
    if packed_multipliers(fmt):
        heads = _six_bit_pairs(*mults)
    else:
        heads = np.concatenate([m.view(np.uint8) for m in mults], axis=-1)
    codes = tiles(groups.codes).transpose(0, 2, 3, 1)  # [T, G, group, W]
    if layout == LAYOUT_QUADS_FACTORED:
        codes = _nibble_quads(tiles(groups.codes))
    elif layout in _BYTE_QUAD_LAYOUTS:
        codes = _quad_codes(codes, layout, fmt)
    elif fmt.bits == 4:
        codes = codes[..., : width // 2] | (codes[..., width // 2 :] << 4)
    codes = np.ascontiguousarray(codes).view(np.uint8).reshape(num_tiles, num_super, -1)
    heads = np.ascontiguousarray(heads).reshape(num_tiles, num_super, -1)
    return np.concatenate([supers, heads, codes], axis=-1).reshape(-1)


@dataclass
class QuantizedWeight:
    """A quantized ``[out_features, in_features]`` matrix: ``data`` uint8 bytes and ``meta`` int64 ``[P, 9]``."""

    data: torch.Tensor
    meta: torch.Tensor

    @property
    def out_features(self) -> int:
        return int(self.meta[:, 1].sum())

    @property
    def in_features(self) -> int:
        return int(self.meta[0, 2])

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.meta.numel() * 8

    def type_summary(self) -> str:
        return "+".join(
            f"{b}bit/g{g}" + ("/x8" if layout & ~_SAME_PATH_FLAGS in INT8_ACTIVATION_LAYOUTS else "")
            for b, g, layout in self.meta[:, [3, 4, 8]].tolist()
        )

    @property
    def int8_activations(self) -> bool:
        return bool(np.isin(self.meta[:, 8].numpy() & ~_SAME_PATH_FLAGS, INT8_ACTIVATION_LAYOUTS).any())

    @classmethod
    def from_groups(
        cls,
        parts: list[Groups],
        tile_rows: int,
        int8_activations: bool = False,
        quad_bits: int = 5,
        fp16_heads: bool = True,
        wide_quads: bool = True,
        super_block_acts: bool = True,
    ) -> QuantizedWeight:
        """Parts stacked along the output rows (a fused qkv: q, k, v); each keeps its own format.

        ``tile_rows``: the kernels' panel width (``cpu.kernels.quant_tile_rows()``); any even number for the
        torch path alone. ``int8_activations``: 4-bit parts in the quad layout and 8-bit ones whose codes lie in
        -32..31 in byte quads, those of 8-bit groups of 32 without a min (Q8_0, IQ4) in wide byte quads (the kernel
        then rounds the activations to 8 bits); other parts stay exact.
        ``quad_bits``: the fewest bits a byte quad's code takes: 5 (the loader's) puts the codes that fit in five bits
        (layouts 8 and 9: Q5_0, Q5_1, Q5_K, Q3_K, Q2_K) and the others in six (layouts 6 and 7: Q6_K); 6 puts all in
        six; 8 keeps a byte a code (layouts 3 and 4). The same weights: ``benchmarks/decode_bytes.py`` times them
        side by side. Without ``int8_activations`` the same narrow quads (5 or 6) go to the exact path
        (:data:`LAYOUT_EXACT_QUADS`); 8 keeps layouts 0 and 2 there. ``fp16_heads``: groups of 32
        whose scales and mins are fp16 values keep them in fp16 (:data:`LAYOUT_FP16_HEAD`); False keeps fp32.
        ``wide_quads``: False keeps the wide byte quads' formats (Q8_0, IQ4) exact under ``int8_activations``.
        ``super_block_acts``: the K-quants' activations rounded per super-block of 256 (llama.cpp's Q8_K); False
        rounds them per group of 32 (:data:`LAYOUT_GROUP_ACTS`).
        """
        if quad_bits not in (5, 6, 8):
            raise ValueError(f"byte quads take 5, 6 or 8 bits a code, not {quad_bits}")
        chunks, meta, offset, row = [], [], 0, 0
        in_features = parts[0].codes.shape[1] * parts[0].fmt.group
        for g in parts:
            if g.codes.shape[1] * g.fmt.group != in_features:
                raise ValueError("stacked quantized parts must have the same number of input features")
            if int8_activations and g.fmt == BlockFormat(4, 32, True):
                layout = LAYOUT_QUADS_FACTORED if factored(g) else LAYOUT_QUADS
            elif takes_byte_quads(g) and (int8_activations or quad_bits != 8):
                # narrow quads on both paths (the exact one flagged below); a byte a code in quads for 8-bit ones
                plain, factored_layout = (
                    (LAYOUT_BYTE_QUADS, LAYOUT_BYTE_QUADS_FACTORED)
                    if quad_bits == 8
                    else _FIVE_BIT_LAYOUTS
                    if quad_bits == 5 and takes_five_bits(g)
                    else _SIX_BIT_LAYOUTS
                )
                layout = factored_layout if factored(g) else plain
            elif int8_activations and wide_quads and takes_wide_byte_quads(g):
                layout = LAYOUT_WIDE_BYTE_QUADS
            else:
                layout = LAYOUT_FACTORED if factored(g) else LAYOUT_INPUTS
            bits = 6 if layout in _SIX_BIT_LAYOUTS else 5 if layout in _FIVE_BIT_LAYOUTS else g.fmt.bits
            if fp16_heads and layout in _FP16_HEAD_LAYOUTS and fp16_head(g):
                layout |= LAYOUT_FP16_HEAD
            if not int8_activations and layout & ~LAYOUT_FP16_HEAD in _EXACT_QUAD_LAYOUTS:
                layout |= LAYOUT_EXACT_QUADS
            packed = pack_groups(g, tile_rows, layout)
            if int8_activations and not super_block_acts and layout in _GROUP_ACTS_LAYOUTS:
                layout |= LAYOUT_GROUP_ACTS
            rows = g.codes.shape[0]
            meta.append(
                [
                    offset,
                    rows,
                    in_features,
                    bits,
                    g.fmt.group,
                    int(g.fmt.has_min),
                    row,
                    tile_rows,
                    layout,
                ]
            )
            chunks.append(packed)
            offset += packed.size
            row += rows
        data = torch.from_numpy(np.concatenate(chunks))
        return cls(data, torch.tensor(meta, dtype=torch.int64))

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 weight ``[out, in]`` (or its ``rows``), in plain torch: the reference and the fallback."""
        out = []
        for offset, n, k, bits, group, has_min, _, width, layout in self.meta.tolist():
            layout &= ~(LAYOUT_EXACT_QUADS | LAYOUT_GROUP_ACTS)  # the same bytes either way
            num_groups, num_tiles = k // group, -(-n // width)
            if layout in _FACTORED_LAYOUTS:
                out.append(self._dequantize_factored(offset, n, k, bits, group, has_min, width, layout))
                continue
            field_dtype = torch.float16 if layout & LAYOUT_FP16_HEAD else torch.float32
            layout &= ~LAYOUT_FP16_HEAD
            field_bytes = field_dtype.itemsize * width
            head = (2 if has_min else 1) * field_bytes
            group_bytes = head + group * width * bits // 8
            tiles = self.data[offset : offset + num_tiles * num_groups * group_bytes]
            tiles = tiles.view(num_tiles, num_groups, group_bytes)
            scale = (
                tiles[..., :field_bytes].contiguous().view(field_dtype).float()[:, :, None, :]
            )  # [T, G, 1, W]
            codes = tiles[..., head:].reshape(num_tiles, num_groups, group, -1)  # [T, G, group, W or W/2]
            if layout == LAYOUT_QUADS:
                q = _from_nibble_quads(tiles[..., head:], width)
            elif layout in _BYTE_QUAD_LAYOUTS:
                q = _from_quad_codes(tiles[..., head:], layout, group, width, has_min)
            elif bits == 4:
                q = torch.cat([codes & 15, codes >> 4], dim=-1).float()  # [T, G, group, W]
            else:
                q = codes.contiguous().view(torch.int8).float()
            if has_min:
                minimum = tiles[..., field_bytes:head].contiguous().view(field_dtype).float()[:, :, None, :]
                w = torch.addcmul(minimum, q, scale)
            else:
                w = q * scale
            out.append(w.permute(0, 3, 1, 2).reshape(num_tiles * width, k)[:n])  # [T, W, G, group] -> rows
        full = torch.cat(out)
        return full if rows is None else full[rows]

    def _dequantize_factored(
        self, offset: int, n: int, k: int, bits: int, group: int, has_min: int, width: int, layout: int
    ) -> torch.Tensor:
        """One layout-2 part as fp32 ``[n, k]``: scale = unit * multiplier (exact), then as layout 0."""
        num_groups, num_tiles = k // group, -(-n // width)
        per_super, fields = QK_K // group, 2 if has_min else 1
        num_super = num_groups // per_super
        packed = packed_multipliers(BlockFormat(bits, group, bool(has_min)))
        head = 3 * width // 2 if packed else fields * width  # a group's multipliers
        code_bytes = group * width * bits // 8
        unit_bytes = fields * 2 * width
        super_bytes = unit_bytes + per_super * (head + code_bytes)
        tiles = self.data[offset : offset + num_tiles * num_super * super_bytes]
        tiles = tiles.view(num_tiles, num_super, super_bytes)
        units = tiles[..., :unit_bytes].contiguous().view(torch.float16).float()  # [T, S, fields * W]
        heads = tiles[..., unit_bytes : unit_bytes + per_super * head].reshape(
            num_tiles, num_super, per_super, head
        )
        if packed:
            nib, top = heads[..., :width].int(), heads[..., width:].int()
            top = torch.cat([top & 15, top >> 4], dim=-1)  # [.., W]: 4 bits a row
            mults = torch.cat([(nib & 15) | ((top & 3) << 4), (nib >> 4) | ((top >> 2) << 4)], dim=-1).float()
        else:
            mults = heads.contiguous().view(torch.int8).float()  # [T, S, per_super, fields * W]
        factor = units[:, :, None, :] * mults  # [T, S, per_super, fields * W]: exact products
        factor = factor.reshape(num_tiles, num_groups, 1, fields * width)
        scale = factor[..., :width]  # [T, G, 1, W]
        raw = tiles[..., unit_bytes + per_super * head :].reshape(num_tiles, num_groups, code_bytes)
        if layout == LAYOUT_QUADS_FACTORED:
            q = _from_nibble_quads(raw, width)
        elif layout in _BYTE_QUAD_LAYOUTS:
            q = _from_quad_codes(raw, layout, group, width, has_min)
        elif bits == 4:
            codes = raw.reshape(num_tiles, num_groups, group, -1)  # [T, G, group, W/2]
            q = torch.cat([codes & 15, codes >> 4], dim=-1).float()  # [T, G, group, W]
        else:
            q = raw.reshape(num_tiles, num_groups, group, -1).contiguous().view(torch.int8).float()
        w = torch.addcmul(factor[..., width:], q, scale) if has_min else q * scale
        return w.permute(0, 3, 1, 2).reshape(num_tiles * width, k)[:n]  # [T, W, G, group] -> rows


def _from_nibble_quads(raw: torch.Tensor, width: int) -> torch.Tensor:
    """Quad-layout 4-bit codes ``[T, G, 16 W]`` (uint8) -> codes ``[T, G, 32, W]`` as floats."""
    t, g = raw.shape[:2]
    quads = raw.reshape(t, g, 8, width // 2, 4)  # [T, G, quad, W/2, 4]
    q = torch.cat([quads & 15, quads >> 4], dim=3).permute(0, 1, 2, 4, 3)  # [T, G, quad, 4, W]
    return q.reshape(t, g, 32, width).float()


def _from_quad_codes(raw: torch.Tensor, layout: int, group: int, width: int, has_min: int) -> torch.Tensor:
    """A byte-quad layout's code bytes ``[T, G, ...]`` -> codes ``[T, G, group, W]`` as floats (the inverse of
    :func:`_quad_codes`)."""
    if layout in _SIX_BIT_LAYOUTS:
        return _from_six_bit_quads(raw, group, width)
    if layout in _FIVE_BIT_LAYOUTS:
        return _from_five_bit_quads(raw, group, width, has_min)
    bias = WIDE_BYTE_QUAD_BIAS if layout == LAYOUT_WIDE_BYTE_QUADS else BYTE_QUAD_BIAS
    return _from_byte_quads(raw, group, width, bias)


def _from_byte_quads(raw: torch.Tensor, group: int, width: int, bias: int = BYTE_QUAD_BIAS) -> torch.Tensor:
    """Byte-quad codes ``[T, G, group * W]`` (uint8, biased by ``bias``) -> codes ``[T, G, group, W]`` as floats."""
    t, g = raw.shape[:2]
    quads = raw.reshape(t, g, group // 4, width, 4).permute(0, 1, 2, 4, 3)  # [T, G, quad, input, W]
    return quads.reshape(t, g, group, width).float() - bias


def _from_six_bit_quads(raw: torch.Tensor, group: int, width: int) -> torch.Tensor:
    """Six-bit quad codes ``[T, G, group / 4 * 3 W]`` (uint8) -> codes ``[T, G, group, W]`` as floats."""
    t, g = raw.shape[:2]
    quads = raw.reshape(t, g, group // 4, 3 * width).to(torch.int32)
    low, high = quads[..., : 2 * width], quads[..., 2 * width :]
    pairs = [
        (high >> shift) & 3 for shift in (0, 2, 4, 6)
    ]  # [.., W] each: first[:W], first[W:], second[:W], ...
    first = (low & 15) | (torch.cat(pairs[:2], dim=-1) << 4)
    second = (low >> 4) | (torch.cat(pairs[2:], dim=-1) << 4)
    return _from_byte_quads(
        torch.cat([first, second], dim=-1).to(torch.uint8).reshape(t, g, -1), group, width
    )


def _from_five_bit_quads(raw: torch.Tensor, group: int, width: int, has_min: int) -> torch.Tensor:
    """Five-bit quad codes ``[T, G, group / 4 * 5 W / 2]`` (uint8) -> codes ``[T, G, group, W]`` as floats."""
    t, g = raw.shape[:2]
    quads = raw.reshape(t, g, group // 4, 5 * width // 2).to(torch.int32)
    low, high = quads[..., : 2 * width], quads[..., 2 * width :]
    # each vector's fifth bits, [.., 2W] each
    fifth = [torch.cat([(high >> (c + 4 * v)) & 1 for c in range(4)], dim=-1) for v in (0, 1)]
    biased = torch.cat([(low & 15) | (fifth[0] << 4), (low >> 4) | (fifth[1] << 4)], dim=-1)
    bias = five_bit_bias(BlockFormat(8, group, bool(has_min)))
    return _from_byte_quads((biased + BYTE_QUAD_BIAS - bias).to(torch.uint8).reshape(t, g, -1), group, width)
