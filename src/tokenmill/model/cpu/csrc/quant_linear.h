// Linear layers over GGUF-quantized weights, kept quantized in memory: y [M, N] = x [M, K] @ W [N, K]^T with x
// and y fp32 and W expanded from 4- or 8-bit codes as it is used, never stored whole as fp32.
//
// The weight layout (tokenmill/model/gguf_blocks.py writes it at load; this file only reads it). Every GGUF
// type tokenmill keeps is one of five block formats, a group being `group` consecutive inputs of one row:
//
//   bits  group  min   from
//   4     32     yes   Q4_0 Q4_1 Q4_K
//   8     32     no    Q8_0, Q5_0 (codes -16..15), IQ4_NL and IQ4_XS (codes: the non-linear table's int8 values)
//   8     32     yes   Q5_K and Q5_1 (codes 0..31)
//   8     16     no    Q6_K (codes -32..31), Q3_K (codes -4..3)
//   8     16     yes   Q2_K (codes 0..3)
//
// and a weight is code * scale + min in fp32, one fused multiply-add: every scale and min is an fp16 times a
// small integer (exact in fp32), and code * scale (+ min) rounded once is what the `gguf` package's dequantize
// computes too: bit for bit the fp32 weights of the dequantizing path.
// Output rows go in tiles of kPanel (panel_linear.h's panel width: 32 on AVX-512, 16 on AVX2, 8 on base); a
// tile stores, per group, the kPanel scales, the kPanel mins (if any), then for each input of the group the
// kPanel codes (4-bit: byte i holds row i low and row i + kPanel/2 high). Expanding one input's codes is then
// one panel row of panel_linear: two vectors of weights, with no transpose. A matrix is one or more parts
// stacked along N (a fused qkv whose v is Q6_K and q, k Q4_K), each with its own format: `meta` [P, 9] int64
// rows of (byte offset, rows, K, bits, group, has_min, first output row, tile rows, layout). Layout 0 is the one
// above; layout 1 (4-bit only) orders each group's codes in quads for 8-bit activations (Q4Quad below; layout 5 is
// layout 1 with layout 2's factored scales), layouts
// 3 and 4 (8-bit codes in -32..31) are layout 0's and layout 2's groups with their codes in quads too (ByteQuad),
// layouts 6 and 7 the same in six bits a code (the meta's bits: 6), layouts 8 and 9 in five (bits: 5), layout 10
// is layout 3 for 8-bit groups of 32 without a min whose codes span -128..127 (Q8_0, IQ4_NL, IQ4_XS: ByteQuad kWide);
// layout 2 (the K-quants, whose scales are a super-block's fp16 times a small integer) stores each group's scales
// and mins as multipliers of per-super-block fp16 units (Fmt's kFactored): the same values in the file's bytes.
// Layouts 0, 1, 3, 6, 8 and 10 with flag 16 (kLayoutFp16Head) keep each group's scales and mins in fp16 instead of fp32
// (Fmt's kHalf): the formats without super-blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL), whose every scale and min
// is an fp16 in the file, read in the file's bytes too. Layouts 6 to 9 with flag 32 (kLayoutExactQuads) are the
// same narrow quads multiplied by the fp32 activations (QuadExact): Q6_K and the five-bit formats in their file's
// bits on the exact path too. The factored quad layouts (4, 5, 7, 9) with flag 64 (kLayoutGroupActs) take their
// 8-bit activations rounded per group of 32 instead of per super-block of 256.
//
// The kernel: for a decode step each thread takes a contiguous run of tiles (read once, in storage order, prefetched
// 32 KB ahead); more rows go in units of a block of rows times a run of tiles, taken as the threads come free
// (work_units.h).
// Up to kQFusedRows rows of x (decode steps, speculative verification) multiply the weights as they are expanded in
// registers, an outer product per input, scale and min once per group (fused_row, fused_rows); more rows (prefill) expand each tile into an fp32 panel and run panel_linear's
// register-blocked kernel over it: once per call when the rows are more than one ~256 KB block of x (the
// thread's panels then stream from cache as panel_linear's do from memory), else once per ~1 MB block of x. A wide K (a
// down projection), whose blocks of x would hold only a few rows, goes in pieces of K instead (quant_linear_chunked:
// each tile's piece expanded once per block of 64 rows, not per 8). A matrix with
// quad-layout parts (quantization="gguf-q8": Q4Quad, ByteQuad) goes through quant_linear_q8: x rounded to 8 bits
// once (twice for a matrix of K-quant and other parts: per super-block and per group, Q8Acts), every row count
// through the same integer-dot-product blocks (q8_rows); quant_linear_silu rounds an MLP's silu(gate) * up as it
// makes it (SiluRows), where every part takes 8-bit activations.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "elementwise.h"
#include "panel_linear.h"
#include "simd.h"
#include "work_units.h"

namespace {

constexpr int kQFusedRows = simd::kNumRegs >= 32 ? 8 : 4;  // x rows multiplied as the weights are expanded ...
// ... in blocks of up to this many rows through fused_rows: per input the codes are converted once for the block,
// scale and min applied once per group and row (4 accumulators a row: 6 rows fill 24 of AVX-512's 32 registers,
// 2 rows 8 of AVX2's 16). Zen 4, AVX-512, the 1.5B's gate/up projection (1536 -> 17920, Q4_K): 4 rows 1.37 ms and
// 8 rows 2.7 ms, where expanding the weights for blocks of up to 8 rows had cost 3.3 and 6.1 ms (1 row: 0.61 ms,
// at the memory's speed). Speculative verification rows and small decode batches are 2-8 rows.
constexpr int kQBlockRows = simd::kNumRegs >= 32 ? 6 : 2;
constexpr int kQSplit = 4;                                 // independent sums per output at one row
// Software prefetch distance into L2, every cache line of a group: as small_linear.h found, the hardware
// prefetchers alone keep too few lines in flight for a decode step to read at memory speed.
constexpr int64_t kQPrefetchBytes = 32768;
// Beyond one block of x rows a call expands every tile once, into the calling thread's buffer (kept across calls), up
// to this many bytes of fp32 panels (the 1.5B's qkv projection, 12.6 MB, fits; its LM head's 933 MB or gate/up
// projection's 110 MB would not: they go tile by tile).
constexpr int64_t kQExpandOnceBytes = 32 << 20;
// Past that, each tile is expanded once per block of x rows of this many bytes: 1 MB, 170 rows of the 1.5B's 1,536
// inputs, where panel_linear's 256 KB (40 rows) expanded a gate/up tile 26 times for 1,024 rows. The 1.5B's gate/up
// projection at 1,024 rows on the exact path: 1.08-1.12x with blocks of 1, 2 and 8 MB (all rows), alternated with
// 256 KB in one process (AMD EPYC family 26 model 2, Zen 5, 2 threads, 2026-12-07); x streams from L2 and L3 as the
// expanded tile (L2-resident) passes it.
constexpr int64_t kQTileBlockBytes = 1 << 20;

// Every cache line of a group's `bytes`, kQPrefetchBytes ahead, into L2.
inline void prefetch_group(const uint8_t* g, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) simd::prefetch_l2(g + kQPrefetchBytes + off);
}

// A group's format at compile time: where group g of a tile starts, its scales (and mins) as vectors, where the
// codes of input d start, and the expansion of one input's kPanel codes into two vectors of weights (rows
// 0..kLanes-1, kLanes..kPanel-1). kFactored (layouts 2, 4, 5, 7: the K-quants): the tile is super-blocks of 256
// inputs, each its kPanel fp16 units of the scales (then of the mins), then every group's multipliers, then every
// group's codes (a group is its codes alone); scale = unit * multiplier, an fp16 times a small integer, exact in fp32
// and so the same value layout 0 stores. The multipliers are kPanel int8 per field, or, for groups of 32 with a min
// (Q4_K, Q5_K: 6-bit scales and mins in the file), six bits each (kPacked: a byte of the two low nibbles per row,
// then a byte of top bit pairs per two rows, simd::six_bit_pairs): Q4_K in its file's 4.5 bits a weight, Q6_K's
// head in its file's 0.5625 bits.
template <int Bits, int Group, bool kMin, bool kFactored = false, bool kHalf = false>
struct Fmt {
  static_assert(!(kFactored && kHalf), "a factored layout keeps its units in fp16 already");
  static constexpr int kGroup = Group;
  static constexpr int kFields = kMin ? 2 : 1;                         // scales, and mins
  static constexpr bool kPacked = kFactored && kMin && Group == 32;    // six-bit multiplier pairs
  static constexpr int64_t kMultBytes = kPacked ? kPanel + kPanel / 2 : kFields * kPanel;  // a group's multipliers
  // per group, before its codes: the fields in fp32, or (kHalf: meta layout flag 16) in fp16, as the file keeps them
  static constexpr int64_t kHead = kFactored ? 0 : kFields * kPanel * (kHalf ? 2 : 4);
  static constexpr int64_t kInputBytes = kPanel * Bits / 8;
  static constexpr int64_t kGroupBytes = kHead + Group * kInputBytes;
  static constexpr int64_t kPerSuper = kFactored ? 256 / Group : 1;  // groups per super-block
  static constexpr int64_t kUnitBytes = kFields * kPanel * 2;           // the fp16 units
  static constexpr int64_t kSuperHead = kFactored ? kUnitBytes + kPerSuper * kMultBytes : 0;
  static constexpr int64_t kSuperBytes = kSuperHead + kPerSuper * kGroupBytes;
  static constexpr int64_t tile_bytes(int64_t num_groups) { return num_groups / kPerSuper * kSuperBytes; }
  static const uint8_t* super(const uint8_t* tile, int64_t g) { return tile + (g / kPerSuper) * kSuperBytes; }
  static const uint8_t* group(const uint8_t* tile, int64_t g) {
    return super(tile, g) + kSuperHead + (g % kPerSuper) * kGroupBytes;
  }
  static const uint8_t* multipliers(const uint8_t* tile, int64_t g) {
    return super(tile, g) + kUnitBytes + (g % kPerSuper) * kMultBytes;
  }

  struct Params {
    simd::Vec s0, s1, m0, m1;
  };
  static Params params(const uint8_t* tile, int64_t g) {
    using namespace simd;
    Params p{zero(), zero(), zero(), zero()};
    if constexpr (kFactored) {
      const uint16_t* u = reinterpret_cast<const uint16_t*>(super(tile, g));
      const uint8_t* mult = multipliers(tile, g);
      if constexpr (kPacked) {
        six_bit_pairs(mult, mult + kPanel, p.s0, p.s1, p.m0, p.m1);
        p.s0 = mul(load_f16(u), p.s0), p.s1 = mul(load_f16(u + kLanes), p.s1);
        p.m0 = mul(load_f16(u + kPanel), p.m0), p.m1 = mul(load_f16(u + kPanel + kLanes), p.m1);
      } else {
        p.s0 = mul(load_f16(u), i8_to_float(mult)), p.s1 = mul(load_f16(u + kLanes), i8_to_float(mult + kLanes));
        if constexpr (kMin)
          p.m0 = mul(load_f16(u + kPanel), i8_to_float(mult + kPanel)),
          p.m1 = mul(load_f16(u + kPanel + kLanes), i8_to_float(mult + kPanel + kLanes));
      }
    } else if constexpr (kHalf) {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(group(tile, g));
      p.s0 = load_f16(h), p.s1 = load_f16(h + kLanes);
      if constexpr (kMin) p.m0 = load_f16(h + kPanel), p.m1 = load_f16(h + kPanel + kLanes);
    } else {
      const float* f = reinterpret_cast<const float*>(group(tile, g));
      p.s0 = load(f), p.s1 = load(f + kLanes);
      if constexpr (kMin) p.m0 = load(f + kPanel), p.m1 = load(f + kPanel + kLanes);
    }
    return p;
  }
  static_assert(Bits != 4 || kMin, "4-bit groups have a min");
  // one input's codes (rows 0 .. kLanes - 1, kLanes .. kPanel - 1) as weights: code * scale (+ min), one rounding
  static void weights(simd::Vec q0, simd::Vec q1, const Params& p, simd::Vec& w0, simd::Vec& w1) {
    if constexpr (kMin)
      w0 = simd::fmadd(q0, p.s0, p.m0), w1 = simd::fmadd(q1, p.s1, p.m1);
    else
      w0 = simd::mul(q0, p.s0), w1 = simd::mul(q1, p.s1);
  }
  static void expand(const uint8_t* g, int64_t d, const Params& p, simd::Vec& w0, simd::Vec& w1) {
    simd::Vec q0, q1;
    codes(g, d, q0, q1);
    weights(q0, q1, p, w0, w1);
  }
  // input d's codes as floats, unscaled (the one-row path applies scale and min once per group)
  static void codes(const uint8_t* g, int64_t d, simd::Vec& q0, simd::Vec& q1) {
    using namespace simd;
    const uint8_t* c = g + kHead + d * kInputBytes;
    if constexpr (Bits == 4)
      u4_to_float(c, q0, q1);
    else
      q0 = i8_to_float(c), q1 = i8_to_float(c + kLanes);
  }
  static constexpr bool kHasMin = kMin;
  static constexpr bool kQuads = false;  // codes in quads of 4 inputs (QuadExact), read a quad at a time
  // group g's share of the stream, kQPrefetchBytes ahead: its bytes, or (factored) its 1/kPerSuper of its
  // super-block, head included, so the heads are fetched ahead as the codes are.
  static void prefetch(const uint8_t* tile, int64_t g) {
    if constexpr (kFactored)
      prefetch_group(super(tile, g) + (g % kPerSuper) * (kSuperBytes / kPerSuper), kSuperBytes / kPerSuper);
    else
      prefetch_group(group(tile, g), kGroupBytes);
  }
  static_assert(!kMin || Group == 32 || Group == 16, "the one-row path has x's sums over groups of 32 and 16");
  // the weight of tile row r (< kPanel) in group g at input d, as a scalar: the embedding lookup's path
  static float weight(const uint8_t* tile, int64_t g, int64_t d, int64_t r) {
    const uint8_t* c = group(tile, g) + kHead + d * kInputBytes;
    float q;
    if constexpr (Bits == 4)
      q = static_cast<float>(r < kPanel / 2 ? c[r] & 15 : c[r - kPanel / 2] >> 4);
    else
      q = static_cast<float>(static_cast<int8_t>(c[r]));
    return scaled(tile, g, r, q);
  }
  // code q of tile row r in group g as its weight: q * scale (+ min), one rounding
  static float scaled(const uint8_t* tile, int64_t g, int64_t r, float q) {
    float scale, minimum = 0.f;
    if constexpr (kFactored) {
      const uint16_t* u = reinterpret_cast<const uint16_t*>(super(tile, g));
      const uint8_t* mult = multipliers(tile, g);
      float sm, mm = 0.f;  // the multipliers
      if constexpr (kPacked) {
        const int half = kPanel / 2, hi = mult[kPanel + r % half] >> (r < half ? 0 : 4);
        sm = float((mult[r] & 15) | ((hi & 3) << 4)), mm = float((mult[r] >> 4) | ((hi & 12) << 2));
      } else {
        sm = float(static_cast<int8_t>(mult[r]));
        if (kMin) mm = float(static_cast<int8_t>(mult[kPanel + r]));
      }
      scale = c10::detail::fp16_ieee_to_fp32_value(u[r]) * sm;
      if (kMin) minimum = c10::detail::fp16_ieee_to_fp32_value(u[kPanel + r]) * mm;
    } else if constexpr (kHalf) {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(group(tile, g));
      scale = c10::detail::fp16_ieee_to_fp32_value(h[r]);
      if (kMin) minimum = c10::detail::fp16_ieee_to_fp32_value(h[kPanel + r]);
    } else {
      const float* f = reinterpret_cast<const float*>(group(tile, g));
      scale = f[r];
      if (kMin) minimum = f[kPanel + r];
    }
    return kMin ? std::fma(q, scale, minimum) : q * scale;
  }
};

// c[0:ncols] = one row of x . every row of the tile, as sum over groups of scale * (x . codes) + min * sum(x):
// per input one conversion and one FMA per vector, scale and min once per group (the decode step's case:
// about a quarter fewer instructions than expanding each weight, which is what bounds it). xsum: the row's
// RowSums (sums over groups of 32, then over groups of 16).
template <class F>
inline void fused_row(const float* x, const float* xsum, const uint8_t* tile, int64_t num_groups, float* c,
                      int64_t ncols) {
  using namespace simd;
  Vec acc0 = zero(), acc1 = zero();
  const float* sums = xsum + (F::kGroup == 16 ? num_groups / 2 : 0);  // this format's group size
  for (int64_t g = 0; g < num_groups; ++g) {
    const uint8_t* grp = F::group(tile, g);
    F::prefetch(tile, g);
    const float* xg = x + g * F::kGroup;
    Vec t0[kQSplit], t1[kQSplit];
    for (int s = 0; s < kQSplit; ++s) t0[s] = t1[s] = zero();
    for (int64_t d = 0; d < F::kGroup; d += kQSplit) {
      Vec q0[kQSplit], q1[kQSplit];
      if constexpr (F::kQuads) {
        static_assert(kQSplit == 4, "a quad is kQSplit inputs");
        F::quad_codes(grp, int(d / 4), q0, q1);
      } else {
        for (int s = 0; s < kQSplit; ++s) F::codes(grp, d + s, q0[s], q1[s]);
      }
      for (int s = 0; s < kQSplit; ++s) {
        const Vec xv = set1(xg[d + s]);
        t0[s] = fmadd(xv, q0[s], t0[s]);
        t1[s] = fmadd(xv, q1[s], t1[s]);
      }
    }
    for (int s = 1; s < kQSplit; ++s) t0[0] = add(t0[0], t0[s]), t1[0] = add(t1[0], t1[s]);
    const auto p = F::params(tile, g);
    acc0 = fmadd(t0[0], p.s0, acc0);
    acc1 = fmadd(t1[0], p.s1, acc1);
    if constexpr (F::kHasMin) {
      const Vec xs = set1(sums[g]);
      acc0 = fmadd(xs, p.m0, acc0);
      acc1 = fmadd(xs, p.m1, acc1);
    }
  }
  store_panel_row(c, acc0, acc1, ncols);
}

// fused_row for R rows at once: the codes converted once per input serve every row, scale and min applied once per
// group and row. xsum: each row's RowSums, `lds` apart.
template <class F, int R>
inline void fused_rows(const float* x, int64_t lda, const float* xsum, int64_t lds, const uint8_t* tile,
                       int64_t num_groups, float* c, int64_t ldc, int64_t ncols) {
  using namespace simd;
  Vec acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = zero();
  const int64_t sums = F::kGroup == 16 ? num_groups / 2 : 0;  // this format's group size
  for (int64_t g = 0; g < num_groups; ++g) {
    const uint8_t* grp = F::group(tile, g);
    F::prefetch(tile, g);
    const float* xg = x + g * F::kGroup;
    Vec t0[R], t1[R];
    for (int r = 0; r < R; ++r) t0[r] = t1[r] = zero();
    if constexpr (F::kQuads) {
      for (int u = 0; u < F::kGroup / 4; ++u) {
        Vec q0[4], q1[4];
        F::quad_codes(grp, u, q0, q1);
        for (int j = 0; j < 4; ++j)
          for (int r = 0; r < R; ++r) {
            const Vec xv = set1(xg[r * lda + 4 * u + j]);
            t0[r] = fmadd(xv, q0[j], t0[r]);
            t1[r] = fmadd(xv, q1[j], t1[r]);
          }
      }
    } else {
      for (int64_t d = 0; d < F::kGroup; ++d) {
        Vec q0, q1;
        F::codes(grp, d, q0, q1);
        for (int r = 0; r < R; ++r) {
          const Vec xv = set1(xg[r * lda + d]);
          t0[r] = fmadd(xv, q0, t0[r]);
          t1[r] = fmadd(xv, q1, t1[r]);
        }
      }
    }
    const auto p = F::params(tile, g);
    for (int r = 0; r < R; ++r) {
      acc0[r] = fmadd(t0[r], p.s0, acc0[r]);
      acc1[r] = fmadd(t1[r], p.s1, acc1[r]);
    }
    if constexpr (F::kHasMin) {
      for (int r = 0; r < R; ++r) {
        const Vec xs = set1(xsum[r * lds + sums + g]);
        acc0[r] = fmadd(xs, p.m0, acc0[r]);
        acc1[r] = fmadd(xs, p.m1, acc1[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store_panel_row(c + r * ldc, acc0[r], acc1[r], ncols);
}

template <class F, int R>
inline void fused_rows_n(int rows, const float* x, int64_t lda, const float* xsum, int64_t lds, const uint8_t* tile,
                         int64_t num_groups, float* c, int64_t ldc, int64_t ncols) {
  if constexpr (R >= 1) {
    if (rows == R) return fused_rows<F, R>(x, lda, xsum, lds, tile, num_groups, c, ldc, ncols);
    fused_rows_n<F, R - 1>(rows, x, lda, xsum, lds, tile, num_groups, c, ldc, ncols);
  }
}

// Groups [g0, g1) of the tile as an fp32 panel [(g1 - g0) * group, kPanel] (pack_panels' layout), for
// panel_linear's kernel.
template <class F>
inline void expand_groups(const uint8_t* tile, int64_t g0, int64_t g1, float* panel) {
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* grp = F::group(tile, g);
    F::prefetch(tile, g);
    const auto p = F::params(tile, g);
    float* out = panel + (g - g0) * F::kGroup * kPanel;
    if constexpr (F::kQuads) {
      for (int u = 0; u < F::kGroup / 4; ++u) {
        simd::Vec q0[4], q1[4];
        F::quad_codes(grp, u, q0, q1);
        for (int j = 0; j < 4; ++j) {
          simd::Vec w0, w1;
          F::weights(q0[j], q1[j], p, w0, w1);
          simd::store(out + (4 * u + j) * kPanel, w0), simd::store(out + (4 * u + j) * kPanel + simd::kLanes, w1);
        }
      }
    } else {
      for (int64_t d = 0; d < F::kGroup; ++d) {
        simd::Vec w0, w1;
        F::expand(grp, d, p, w0, w1);
        simd::store(out + d * kPanel, w0), simd::store(out + d * kPanel + simd::kLanes, w1);
      }
    }
  }
}

// The whole tile as an fp32 panel [K, kPanel].
template <class F>
inline void expand_panel(const uint8_t* tile, int64_t num_groups, float* panel) {
  expand_groups<F>(tile, 0, num_groups, panel);
}

// Rows [m0, m1) of x (rows lda apart) times an expanded panel [depth, kPanel], in near-equal register blocks;
// kAccumulate: added to y (a later piece of the depth).
template <bool kPrefetch, bool kAccumulate = false>
inline void panel_rows(const float* x, int64_t lda, int64_t m0, int64_t m1, int64_t depth, const float* panel,
                       float* y, int64_t ldy, int64_t ncols) {
  const int64_t num_chunks = (m1 - m0 + kPanelMaxRows - 1) / kPanelMaxRows;
  int64_t m = m0;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t rows = (m1 - m) / (num_chunks - c);  // near-equal chunks of at most kPanelMaxRows
    panel_block_n<kPanelMaxRows, kPrefetch, kAccumulate>(static_cast<int>(rows), x + m * lda, lda, panel, kPanel,
                                                         depth, y + m * ldy, ldy, ncols);
    m += rows;
  }
}

// Per row of x, its sums over groups of 32 inputs, then over groups of 16 (every format with a min has one of the
// two): what fused_row(s) need for a block of at most kQFusedRows rows, [M, stride(K)]. Rows go in blocks of
// `block_rows` from row 0: the sums are computed for the rows of such blocks only (the last one, unless every block
// is that small). A tail block of one row once read sums never written (Qwen2.5-1.5B's down projection).
class RowSums {
 public:
  static int64_t stride(int64_t K) { return K / 32 + K / 16; }
  RowSums(const float* x, int64_t M, int64_t K, int64_t block_rows) {
    if (M == 0) return;
    // Blocks of at most kQFusedRows rows go through fused_row(s) and need their rows' sums: every block when the
    // blocks are that small (a wide K), else only the last one, when it is.
    const int64_t last = (M - 1) / block_rows * block_rows;  // the last block's first row
    const int64_t first = block_rows <= kQFusedRows ? 0 : (M - last <= kQFusedRows ? last : M);
    if (first == M) return;
    sums_.reset(new float[M * stride(K)]);
    for (int64_t m = first; m < M; ++m) {
      const float* row = x + m * K;
      float* out = sums_.get() + m * stride(K);
      for (int64_t group : {32, 16})
        for (int64_t g = 0; g < K / group; ++g) {
          float acc = 0.f;
          for (int64_t k = g * group; k < (g + 1) * group; ++k) acc += row[k];
          *out++ = acc;
        }
    }
  }
  const float* data() const { return sums_.get(); }

 private:
  std::unique_ptr<float[]> sums_;
};

// Rows [m0, m1) of x times one tile: expanded in registers for a few rows, else into `panel` first.
template <class F>
inline void tile_rows(const float* x, const float* xsum, int64_t m0, int64_t m1, int64_t K, const uint8_t* tile,
                      int64_t num_groups, float* panel, float* y, int64_t ldy, int64_t ncols) {
  const int64_t M = m1 - m0;
  if (M == 1) {
    // the caller's RowSums cover every row of a block this small (see RowSums)
    fused_row<F>(x + m0 * K, xsum + m0 * RowSums::stride(K), tile, num_groups, y + m0 * ldy, ncols);
    return;
  }
  if (M <= kQFusedRows) {
    for (int64_t m = m0; m < m1; m += kQBlockRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kQBlockRows, m1 - m));
      const int64_t lds = RowSums::stride(K);
      fused_rows_n<F, kQBlockRows>(rows, x + m * K, K, xsum + m * lds, lds, tile, num_groups, y + m * ldy, ldy, ncols);
    }
    return;
  }
  expand_panel<F>(tile, num_groups, panel);
  panel_rows<false>(x, K, m0, m1, K, panel, y, ldy, ncols);
}

// The whole tile's rows as fp32: out[r * K + k] for tile rows r < num_rows.
template <class F>
inline void tile_weights(const uint8_t* tile, int64_t num_groups, int64_t row, float* out) {
  for (int64_t g = 0; g < num_groups; ++g)
    for (int64_t d = 0; d < F::kGroup; ++d) out[g * F::kGroup + d] = F::weight(tile, g, d, row);
}

// Meta's layout column: this flag on layouts 0, 1, 3, 6, 8 and 10 keeps each group's scales and mins in fp16 (Fmt's kHalf).
constexpr int64_t kLayoutFp16Head = 16;
// and this one on layouts 6 to 9 multiplies their byte quads by the fp32 activations (QuadExact), not rounded ones.
constexpr int64_t kLayoutExactQuads = 32;
// and this one on the factored quad layouts (4, 5, 7, 9) rounds their activations per group of 32 as the formats
// without super-blocks take them, not per super-block of 256 (llama.cpp's Q8_K for the K-quants): for a model whose
// measured quality holds only that way.
constexpr int64_t kLayoutGroupActs = 64;

// Rows per register block of the 8-bit path: 2 integer and 2 float accumulators a row.
constexpr int kQ8Rows = simd::kNumRegs >= 32 ? 6 : 4;

// The 4-bit format in its quad layout (meta layouts 1 and 5), for 8-bit activations: per group, the kPanel scales
// and mins (layout 5: a K-quant's, as layout 2 keeps them in its super-block's head: six-bit multipliers of fp16
// units, Q4_K's 4.5 bits a weight instead of 6), then 8 quads of 4 consecutive inputs, each 2 * kPanel bytes: byte j holds tile row j / 4
// (low nibble) and row kPanel / 2 + j / 4 (high nibble) at input 4u + j % 4. One load and two masks give simd::qdot
// its operands.
template <bool kFactored, bool kHalf = false>
struct Q4QuadT : Fmt<4, 32, true, kFactored, kHalf> {
  using Base = Fmt<4, 32, true, kFactored, kHalf>;
  static constexpr int kNumQuads = 8;
  static constexpr int32_t kBias = 0;  // codes stored as they are
  static constexpr int32_t kSumBias = 0;  // what the integer sums carry per unit of the activations' code sum
  static constexpr bool kBiasedStart = false;
  static constexpr int64_t kQuadBytes = 2 * kPanel;
  // rows per register block: on 16 registers 4 rows' 8 int16 accumulators left one to spill, its store and reload
  // in every quad's chain (the 1.5B's gate/up projection at 512 rows 84 ms against 65-69 at 3 rows, AVX2 on Zen 4)
  static constexpr int kRows = simd::kNumRegs >= 32 ? kQ8Rows : 3;
  static constexpr int kRun = 1;         // dot adds each quad into Acc (int16 on AVX2 for the whole group)
  static_assert(Base::kGroupBytes == Base::kHead + kNumQuads * kQuadBytes, "a group is its head and 8 quads");
  // quad u's codes: tile rows 0 .. kLanes - 1 (low nibbles) and kLanes .. kPanel - 1 (high)
  static void quad(const uint8_t* grp, int u, simd::QVec& w0, simd::QVec& w1) {
    simd::q4_quad(grp + Base::kHead + u * kQuadBytes, w0, w1);
  }
  using Acc = simd::QAcc;  // int16 pairs on AVX2: 8 quads of codes below 16 cannot overflow them
  static Acc start(const int32_t*) { return simd::qacc_zero(); }  // no bias to take back
  static Acc dot(Acc a, simd::QVec w, simd::QVec x) { return simd::qdot(a, w, x); }
  static simd::Vec to_float(Acc a, int32_t) { return simd::qacc_to_float(a); }
  static float weight(const uint8_t* tile, int64_t group, int64_t d, int64_t r) {  // as Fmt::weight's value
    const int64_t half = kPanel / 2;
    const uint8_t byte = Base::group(tile, group)[Base::kHead + (d / 4) * kQuadBytes + 4 * (r % half) + d % 4];
    return Base::scaled(tile, group, r, static_cast<float>(r < half ? byte & 15 : byte >> 4));
  }
};
using Q4Quad = Q4QuadT<false>;

// Byte codes in quads, for 8-bit activations (meta layouts 3 and 4: layout 0's or layout 2's scales, mins and
// super-block units, with the codes of each group reordered; quantization="gguf-q8" on the 8-bit formats whose
// codes lie in -32..31: Q6_K, Q5_0, Q5_1, Q5_K, Q3_K, Q2_K). Per group, Group / 4 quads of 4 consecutive inputs,
// each 4 * kPanel bytes: byte 4c + j holds tile row c's code at input 4u + j plus kBias (0..63, vpdpbusd's unsigned
// operand). The integer sums take kBias times the activations' code sum back: each group's dot product of codes
// and 8-bit activations exact, as llama.cpp computes Q6_K times Q8_K.
// kCodeBits 6 (meta layouts 6 and 7, what the loader writes for Q6_K): the same quads in six bits a code, 3 * kPanel
// bytes each, a plane of low nibbles and one of top bit pairs (simd::narrow_quad): with layout 2's head (layout 7),
// Q6_K in its file's 6.5625 bits a weight instead of 8.6, the same codes, the same sums.
// kCodeBits 5 (meta layouts 8 and 9: codes that fit five bits, Q5_0, Q5_1, Q5_K, Q3_K, Q2_K): 5 * kPanel / 2 bytes a
// quad, the low nibbles' plane and one of fifth bits (simd::narrow_quad), the codes biased by 16 where they are
// signed (no min: Q5_0's -16..15) and by 0 where not: Q5_0 and Q5_1 in their file's bytes.
// kWide (meta layout 10: Q8_0, IQ4_NL, IQ4_XS, codes anywhere in -128..127): bytes biased by 128, multiplied by
// simd::qdot_wide (vpdpbusd as they are; on AVX2 the code's sign moves onto the activation), the sums carrying
// simd::kWideSumBias times the activations' code sum.
template <int Group, bool kMin, bool kFactored, int kCodeBits = 8, bool kHalf = false, bool kWide = false>
struct ByteQuad : Fmt<kCodeBits, Group, kMin, kFactored, kHalf> {
  static_assert(kCodeBits == 8 || kCodeBits == 6 || kCodeBits == 5, "byte quads are 8, 6 or 5 bits a code");
  static_assert(!kWide || (kCodeBits == 8 && !kFactored), "wide byte quads are a byte a code, not factored");
  using Base = Fmt<kCodeBits, Group, kMin, kFactored, kHalf>;
  static constexpr int kNumQuads = Group / 4;
  static constexpr int32_t kBias = kWide ? 128 : kCodeBits == 5 ? (kMin ? 0 : 16) : 32;  // added to each code
  static constexpr int32_t kSumBias = kWide ? simd::kWideSumBias : kBias;
  static constexpr int64_t kQuadBytes = kCodeBits * kPanel / 2;
  // rows per register block: on 16 registers the six-bit unpack's constants and temporaries leave room for 3 rows'
  // accumulators, not 4 (4 spilled: the 1.5B's head at 64 rows took 1.48x a byte quad's time on AVX2, 1.0x at 3)
  static constexpr int kRows = kCodeBits != 8 && simd::kNumRegs < 32 ? 3 : kQ8Rows;
  // quads whose pair sums add up before joining int32 lanes
  static constexpr int kRun = kWide ? 1 : simd::quad_run(kCodeBits);
  static_assert(Base::kGroupBytes == Base::kHead + kNumQuads * kQuadBytes, "a group is its head and its quads");
  static void quad(const uint8_t* grp, int u, simd::QVec& w0, simd::QVec& w1) {
    const uint8_t* q = grp + Base::kHead + u * kQuadBytes;
    if constexpr (kCodeBits == 8)
      w0 = simd::byte_quad(q), w1 = simd::byte_quad(q + 4 * simd::kLanes);
    else
      simd::narrow_quad<kCodeBits>(q, w0, w1);
  }
  using Acc = simd::QAcc32;
  // Where the sums go into int32 lanes at once (kRun 1: AVX-512, AVX-VNNI, base), a group's sums start at minus
  // kSumBias times the activations' code sum and end unbiased: one broadcast a row and group, not a subtraction a
  // row, group and half-tile (the Q6_K down projection 1.07-1.11x on AVX-512). With runs (AVX2) they start at zero
  // and lose the bias as they are converted (started at it, two more live registers: 0.86-0.96x). The same integers
  // either way. `neg`: minus the row's code sum over the group (Q8Acts::neg_sums).
  static constexpr bool kBiasedStart = kRun == 1 && kSumBias != 0;
  static_assert((kSumBias & (kSumBias - 1)) == 0, "a bias that is a power of two: the start is a shift");
  static Acc start(const int32_t* neg) {
    if constexpr (kBiasedStart) return simd::qacc32_start<__builtin_ctz(kSumBias)>(neg);
    return simd::qacc_zero();
  }
  static Acc dot(Acc a, simd::QVec w, simd::QVec x) {
    return kWide ? simd::qdot_wide(a, w, x) : simd::qdot32(a, w, x);
  }
  static simd::Vec to_float(Acc a, int32_t code_sum) {
    if constexpr (kBiasedStart) return simd::qacc32_to_float(a, 0);
    return simd::qacc32_to_float(a, kSumBias * code_sum);
  }
  // the biased code of tile row r at input d (a byte 4r + d % 4 of its quad, the two QVecs' bytes in a row)
  static int32_t code(const uint8_t* q, int64_t r, int64_t d) {
    const int64_t i = 4 * r + d % 4;
    constexpr int64_t kVec = 4 * simd::kLanes;  // a QVec's bytes
    if constexpr (kCodeBits == 8) {
      return q[i];
    } else if constexpr (kCodeBits == 5) {
      const int64_t v = i / kVec, b = i % kVec;  // which QVec, its byte
      const int low = v == 0 ? q[b] & 15 : q[b] >> 4;
      return low | (((q[kVec + b % simd::kLanes] >> (b / simd::kLanes + 4 * v)) & 1) << 4);
    } else {
      constexpr int64_t kHighBytes = kVec / 2;  // the plane of top bit pairs
      const int64_t v = i / kVec, b = i % kVec;   // which QVec, its byte
      const int low = v == 0 ? q[b] & 15 : q[b] >> 4;
      const int shift = 4 * int(v) + (b < kHighBytes ? 0 : 2);
      return low | (((q[kVec + b % kHighBytes] >> shift) & 3) << 4);
    }
  }
  static float weight(const uint8_t* tile, int64_t g, int64_t d, int64_t r) {
    const uint8_t* q = Base::group(tile, g) + Base::kHead + (d / 4) * kQuadBytes;
    return Base::scaled(tile, g, r, static_cast<float>(code(q, r, d) - kBias));
  }
};

// A byte-quad format Q (ByteQuad: meta layouts 6 to 9 with flag kLayoutExactQuads) read by the exact path: the
// same bytes, each quad's codes converted to fp32 for the four inputs at once (simd::quad_input), then as Fmt's
// input-major codes: code * scale (+ min), one rounding, the fp32 weights of layout 0 bit for bit. Q6_K and the
// five-bit formats in their file's bits for fp32 activations too.
template <class Q>
struct QuadExact : Q {
  static constexpr bool kQuads = true;
  // quad u's four inputs: q0[j] the codes of rows 0 .. kLanes - 1 at input 4u + j, q1[j] the rest, unbiased
  static void quad_codes(const uint8_t* grp, int u, simd::Vec q0[4], simd::Vec q1[4]) {
    simd::QVec w0, w1;
    Q::quad(grp, u, w0, w1);
    q0[0] = simd::quad_input<0>(w0, Q::kBias), q1[0] = simd::quad_input<0>(w1, Q::kBias);
    q0[1] = simd::quad_input<1>(w0, Q::kBias), q1[1] = simd::quad_input<1>(w1, Q::kBias);
    q0[2] = simd::quad_input<2>(w0, Q::kBias), q1[2] = simd::quad_input<2>(w1, Q::kBias);
    q0[3] = simd::quad_input<3>(w0, Q::kBias), q1[3] = simd::quad_input<3>(w1, Q::kBias);
  }
};

// Activations rounded to 8 bits, llama.cpp's way: for each row, codes [K] in [-127, 127] and a scale s per group of
// 32 inputs (x ~ code * s), s = max|x| / 127 over the group (llama.cpp's Q8_0 and Q8_1 activations, for the formats
// without super-blocks) or over the group's super-block of 256 inputs (its Q8_K, for the K-quants: the 8 groups of a
// super-block share s); per group of 32 its code sum as a float (the mins), per 16 and per 32 inputs minus the
// integer code sum (ByteQuad's bias, where a group's sums start, and groups of 16).
struct Q8Acts {
  const int8_t* q;
  const float* scale;    // [M, G]
  const float* sum32;    // [M, G]: each group of 32's code sum, an integer below 2^13 (exact)
  const int32_t* neg16;  // [M, K / 16]: minus each 16 inputs' code sum
  const int32_t* neg32;  // [M, G]: minus each group of 32's
  int64_t K, G;
  // row m's minus code sum over group g of `group` (16 or 32) inputs; the next row's is neg_stride(group) further
  const int32_t* neg_sums(int64_t m, int64_t g, int group) const {
    return group == 16 ? neg16 + m * (K / 16) + g : neg32 + m * G + g;
  }
  int64_t neg_stride(int group) const { return group == 16 ? K / 16 : G; }
  int32_t code_sum(int64_t m, int64_t g, int group) const { return -*neg_sums(m, g, group); }
};

// The activations' values as quantize_acts reads them: x [M, K] as it is (DenseRows), or made a span at a time
// (quant_linear_silu's SiluRows). values(m, k0, n, buf): row m's inputs k0 .. k0 + n - 1, in buf or in place.
struct DenseRows {
  const float* x;
  int64_t K;
  const float* values(int64_t m, int64_t k0, int64_t, float*) const { return x + m * K + k0; }
};

// Activation rows -> codes, scales and sums, s over `scale_group` inputs (32, or 256 where K is a multiple of 256):
// code = round_to_even(x * (1 / s)), 0 for an all-zero group.
constexpr int64_t kMaxScaleGroup = 256;
template <class Rows>
inline void quantize_acts(const Rows& rows, int64_t M, int64_t K, int64_t scale_group, int8_t* q, float* scale,
                          float* sum32, int32_t* neg16, int32_t* neg32) {
  using namespace simd;
  constexpr int64_t kGroup = Q4Quad::kGroup;
  TORCH_CHECK(scale_group % kGroup == 0 && scale_group <= kMaxScaleGroup, "scale group ", scale_group);
  const int64_t G = K / kGroup, span = scale_group / kGroup;  // groups of 32 that share a scale
  constexpr int64_t kUnitRows = 16;
  parallel_units((M + kUnitRows - 1) / kUnitRows, [&](int64_t u) {
    alignas(64) float buf[kMaxScaleGroup];
    for (int64_t m = u * kUnitRows; m < std::min(M, (u + 1) * kUnitRows); ++m)
      for (int64_t g0 = 0; g0 < G; g0 += span) {
        const float* vals = rows.values(m, g0 * kGroup, span * kGroup, buf);  // the span's inputs
        Vec amax = zero();
        for (int64_t v = 0; v < span * kGroup; v += kLanes) amax = max(amax, vabs(load(vals + v)));
        const float a = reduce_max(amax), s = a / 127.f, inv = a > 0.f ? 1.f / s : 0.f;
        for (int64_t g = g0; g < g0 + span; ++g) {
          Vec sums[2] = {zero(), zero()};  // the codes of inputs 0..15 and 16..31, added lane by lane
          for (int64_t v = 0; v < kGroup; v += kLanes) {
            const Vec c = min(max(round_nearest(mul(load(vals + (g - g0) * kGroup + v), set1(inv))), set1(-127.f)),
                              set1(127.f));
            store_i8(q + m * K + g * kGroup + v, c);
            sums[v / 16] = add(sums[v / 16], c);
          }
          // integers below 2^11 in magnitude: the float sums are exact
          const int32_t halves[2] = {int32_t(reduce_add(sums[0])), int32_t(reduce_add(sums[1]))};
          neg16[m * (K / 16) + 2 * g] = -halves[0], neg16[m * (K / 16) + 2 * g + 1] = -halves[1];
          neg32[m * G + g] = -(halves[0] + halves[1]);
          scale[m * G + g] = s;
          sum32[m * G + g] = float(halves[0] + halves[1]);
        }
      }
  });
}

// One kind of rounded activations' buffers, kept across calls (a prefill's are megabytes).
class Q8ActsBuffers {
 public:
  template <class Rows>
  Q8Acts round(const Rows& rows, int64_t M, int64_t K, int64_t scale_group) {
    const int64_t G = K / Q4Quad::kGroup;
    if (codes_.size() < size_t(M * K)) codes_.resize(M * K);
    if (scales_.size() < size_t(M * G))
      scales_.resize(M * G), sum32_.resize(M * G), neg16_.resize(2 * M * G), neg32_.resize(M * G);
    quantize_acts(rows, M, K, scale_group, codes_.data(), scales_.data(), sum32_.data(), neg16_.data(),
                  neg32_.data());
    return Q8Acts{codes_.data(), scales_.data(), sum32_.data(), neg16_.data(), neg32_.data(), K, G};
  }

 private:
  std::vector<int8_t> codes_;
  std::vector<float> scales_, sum32_;
  std::vector<int32_t> neg16_, neg32_;
};


// One group's integer sums, codes times activations, for R rows of activations (x, a row every ldx), from F::start
// of each row's minus code sum over the group (neg, a row every ldn): a0 the tile's first kLanes outputs, a1 the
// rest. A format with runs (ByteQuad on AVX2: F::kRun > 1) adds a run of quads' pair sums in int16 and joins them into
// the int32 sums once per run.
template <class F, int R>
inline void q8_group_sums(const uint8_t* grp, const int8_t* x, int64_t ldx, const int32_t* neg, int64_t ldn,
                          typename F::Acc* a0, typename F::Acc* a1) {
  using namespace simd;
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = F::start(neg + r * ldn);
  if constexpr (F::kRun == 1) {
#pragma GCC unroll 2
    for (int u = 0; u < F::kNumQuads; ++u) {
      QVec w0, w1;
      F::quad(grp, u, w0, w1);
      for (int r = 0; r < R; ++r) {
        const QVec xv = x_quad(x + r * ldx + 4 * u);
        a0[r] = F::dot(a0[r], w0, xv);
        a1[r] = F::dot(a1[r], w1, xv);
      }
    }
  } else {
    static_assert(F::kNumQuads % F::kRun == 0, "a group is whole runs");
    for (int u0 = 0; u0 < F::kNumQuads; u0 += F::kRun) {
      QRun s0[R], s1[R];
#pragma GCC unroll 4
      for (int v = 0; v < F::kRun; ++v) {
        QVec w0, w1;
        F::quad(grp, u0 + v, w0, w1);
        for (int r = 0; r < R; ++r) {
          const QVec xv = x_quad(x + r * ldx + 4 * (u0 + v));
          s0[r] = v == 0 ? qrun_first(w0, xv) : qrun_add(s0[r], w0, xv);
          s1[r] = v == 0 ? qrun_first(w1, xv) : qrun_add(s1[r], w1, xv);
        }
      }
      for (int r = 0; r < R; ++r) a0[r] = qrun_join(a0[r], s0[r]), a1[r] = qrun_join(a1[r], s1[r]);
    }
  }
}

// c[r][0:ncols] for rows m .. m + R - 1 of the activations times one tile of F (Q4Quad, ByteQuad): per group, the
// integer dot products of codes and activations (exact), then t += scale * dot + min * (sum of codes), and per
// super-block (a K-quant's 256 inputs, whose activations share their scale s; else per group) y += s * t. Per row
// and half-tile a group costs one multiply-add (two with a min) and a super-block one more, where a scale per group
// of 32 costs a multiplication and two multiply-adds (three with a min) every group: the epilogue that bounds the
// 8-bit path on Zen 4 (docs/performance.md). A super-block's t and the rows' y take more registers than there are:
// y is kept in memory, read and written once per super-block.
// kUnpacked: `heads` holds the tile's groups' scales and mins as q8_blocks_unpacked unpacked them for every block of
// rows; else they are unpacked here. kPrefetch: the tile's stream prefetched ahead (a single block, a decode step's,
// or the first of several).
template <class F, bool kSuperActs, int R, bool kUnpacked, bool kPrefetch>
inline void q8_block(const Q8Acts& x, int64_t m, const uint8_t* tile, const typename F::Params* heads, float* c,
                     int64_t ldc, int64_t ncols) {
  using namespace simd;
  constexpr int64_t kSuper = kSuperActs ? F::kPerSuper : 1;  // groups that share the activations' scale
  Vec f0[R], f1[R];                         // the rows' sums (one group a super-block), or ...
  alignas(64) float fs[kSuper > 1 ? R : 1][kPanel];  // ... in memory (super-blocks of several groups)
  for (int r = 0; r < R; ++r) f0[r] = f1[r] = zero();
  const int64_t num_groups = x.K / F::kGroup;
  for (int64_t g0 = 0; g0 < num_groups; g0 += kSuper) {
    Vec t0[R], t1[R];
    for (int r = 0; r < R; ++r) t0[r] = t1[r] = zero();
    for (int64_t g = g0; g < g0 + kSuper; ++g) {
      const uint8_t* grp = F::group(tile, g);
      if constexpr (kPrefetch) F::prefetch(tile, g);
      typename F::Acc a0[R], a1[R];
      int32_t sums[R];  // the rows' code sums over the group, where a conversion's bias or a min takes them
      constexpr bool kSums = (F::kSumBias && !F::kBiasedStart) || (F::kHasMin && F::kGroup != Q4Quad::kGroup);
      for (int r = 0; r < R; ++r) sums[r] = kSums ? x.code_sum(m + r, g, F::kGroup) : 0;
      q8_group_sums<F, R>(grp, x.q + m * x.K + g * F::kGroup, x.K, x.neg_sums(m, g, F::kGroup),
                          x.neg_stride(F::kGroup), a0, a1);
      const auto p = kUnpacked ? heads[g] : F::params(tile, g);
      for (int r = 0; r < R; ++r) {
        const Vec d0 = F::to_float(a0[r], sums[r]), d1 = F::to_float(a1[r], sums[r]);
        t0[r] = kSuper == 1 ? mul(d0, p.s0) : fmadd(d0, p.s0, t0[r]);
        t1[r] = kSuper == 1 ? mul(d1, p.s1) : fmadd(d1, p.s1, t1[r]);
        if constexpr (F::kHasMin) {
          const Vec xm = set1(F::kGroup == Q4Quad::kGroup ? x.sum32[(m + r) * x.G + g] : float(sums[r]));
          t0[r] = fmadd(p.m0, xm, t0[r]);
          t1[r] = fmadd(p.m1, xm, t1[r]);
        }
      }
    }
    const int64_t gx = g0 * F::kGroup / Q4Quad::kGroup;  // the activations' group of 32
    for (int r = 0; r < R; ++r) {
      const Vec xs = set1(x.scale[(m + r) * x.G + gx]);
      if constexpr (kSuper > 1) {  // (a zeroed array's initialisation cost 6% of a 512-row matmul)
        store(fs[r], g0 == 0 ? mul(t0[r], xs) : fmadd(t0[r], xs, load(fs[r])));
        store(fs[r] + kLanes, g0 == 0 ? mul(t1[r], xs) : fmadd(t1[r], xs, load(fs[r] + kLanes)));
      } else {
        f0[r] = fmadd(t0[r], xs, f0[r]);
        f1[r] = fmadd(t1[r], xs, f1[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (kSuper > 1) f0[r] = load(fs[r]), f1[r] = load(fs[r] + kLanes);
    store_panel_row(c + r * ldc, f0[r], f1[r], ncols);
  }
}

template <class F, bool kSuperActs, int R, bool kUnpacked, bool kPrefetch>
inline void q8_block_n(int rows, const Q8Acts& x, int64_t m, const uint8_t* tile, const typename F::Params* heads,
                       float* c, int64_t ldc, int64_t ncols) {
  if constexpr (R >= 1) {
    if (rows == R) return q8_block<F, kSuperActs, R, kUnpacked, kPrefetch>(x, m, tile, heads, c, ldc, ncols);
    q8_block_n<F, kSuperActs, R - 1, kUnpacked, kPrefetch>(rows, x, m, tile, heads, c, ldc, ncols);
  }
}

// q8_rows for more than one register block: the groups' scales and mins unpacked once for all the blocks (a K-quant's
// six-bit multipliers times its fp16 units: about as many instructions per group as one row's epilogue), the tile's
// stream prefetched group by group during the first block (the whole tile's prefetches issued up front, before the
// first block, leave 16-row decode steps waiting on memory: the 1.5B's LM head at 16 rows 22.4 ms against 17.4).
// Out of line: inlined into q8_rows, it changed how GCC laid out the one-block path (a decode step's), 6% slower at
// one row on AVX2.
template <class F, bool kSuperActs>
__attribute__((noinline)) void q8_blocks_unpacked(const Q8Acts& x, int64_t m0, int64_t m1, int64_t num_chunks,
                                                  const uint8_t* tile, float* y, int64_t ldy, int64_t ncols) {
  thread_local std::vector<typename F::Params> heads;
  const int64_t num_groups = x.K / F::kGroup;
  if (heads.size() < size_t(num_groups)) heads.resize(num_groups);
  for (int64_t g = 0; g < num_groups; ++g) heads[g] = F::params(tile, g);
  int64_t m = m0;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int rows = static_cast<int>((m1 - m) / (num_chunks - c));
    if (c == 0)
      q8_block_n<F, kSuperActs, F::kRows, true, true>(rows, x, m, tile, heads.data(), y + m * ldy, ldy, ncols);
    else
      q8_block_n<F, kSuperActs, F::kRows, true, false>(rows, x, m, tile, heads.data(), y + m * ldy, ldy, ncols);
    m += rows;
  }
}

// Rows [m0, m1) times one tile of F, in near-equal register blocks; every row count takes the same arithmetic (an
// output's value does not depend on the batch it came in).
template <class F, bool kSuperActs>
inline void q8_rows(const Q8Acts& x, int64_t m0, int64_t m1, const uint8_t* tile, float* y, int64_t ldy,
                    int64_t ncols) {
  const int64_t num_chunks = (m1 - m0 + F::kRows - 1) / F::kRows;
  if (num_chunks > 1) return q8_blocks_unpacked<F, kSuperActs>(x, m0, m1, num_chunks, tile, y, ldy, ncols);
  q8_block_n<F, kSuperActs, F::kRows, false, true>(static_cast<int>(m1 - m0), x, m0, tile, nullptr, y + m0 * ldy,
                                                   ldy, ncols);
}

using TileRowsFn = void (*)(const float*, const float*, int64_t, int64_t, int64_t, const uint8_t*, int64_t, float*,
                            float*, int64_t, int64_t);
using TileWeightsFn = void (*)(const uint8_t*, int64_t, int64_t, float*);
using ExpandPanelFn = void (*)(const uint8_t*, int64_t, float*);
using ExpandGroupsFn = void (*)(const uint8_t*, int64_t, int64_t, float*);
using Q8RowsFn = void (*)(const Q8Acts&, int64_t, int64_t, const uint8_t*, float*, int64_t, int64_t);

struct QuantPart {
  const uint8_t* data = nullptr;  // the part's first tile
  int64_t rows = 0, col = 0, num_groups = 0, tile_bytes = 0, num_tiles = 0;
  TileRowsFn tile_rows = nullptr;
  TileWeightsFn tile_weights = nullptr;
  ExpandPanelFn expand_panel = nullptr;
  ExpandGroupsFn expand_groups = nullptr;
  int64_t group = 0;  // inputs per group
  Q8RowsFn q8_rows = nullptr;  // quad layouts: multiplied by the activations rounded to 8 bits (else exact)
  bool super_acts = false;     // ... with one scale per super-block of 256 inputs (a K-quant's), else per 32
};

struct QuantMatrix {
  std::vector<QuantPart> parts;
  std::vector<int64_t> first_tile;  // per part, its first tile's global index; then the total
  int64_t n = 0, k = 0;
  bool q8_group_acts = false, q8_super_acts = false;  // which roundings of the activations its parts take
  bool has_q8() const { return q8_group_acts || q8_super_acts; }
  bool all_q8() const {  // every part on the 8-bit path: the activations needed only as codes
    return std::all_of(parts.begin(), parts.end(), [](const QuantPart& p) { return p.q8_rows != nullptr; });
  }
  int64_t num_tiles() const { return first_tile.back(); }
  size_t part_of(int64_t tile) const {
    return static_cast<size_t>(std::upper_bound(first_tile.begin(), first_tile.end(), tile) - first_tile.begin() - 1);
  }
  // fn(t, part, bytes, col, ncols) for each tile t in [t0, t1): its part, its bytes, the output column of its
  // first row and its row count (kPanel, fewer in a part's last tile).
  template <class Fn>
  void for_each_tile(int64_t t0, int64_t t1, Fn&& fn) const {
    size_t p = part_of(t0);
    for (int64_t t = t0; t < t1; ++t) {
      while (t >= first_tile[p + 1]) ++p;
      const QuantPart& part = parts[p];
      const int64_t local = t - first_tile[p];
      fn(t, part, part.data + local * part.tile_bytes, part.col + local * kPanel,
         std::min(kPanel, part.rows - local * kPanel));
    }
  }
};

// A format F (Fmt, QuadExact) on the exact path.
template <class F>
inline void set_exact_format(QuantPart& p) {
  p.super_acts = false;  // the exact path rounds no activations
  p.tile_rows = &tile_rows<F>;
  p.tile_weights = &tile_weights<F>;
  p.expand_panel = &expand_panel<F>;
  p.expand_groups = &expand_groups<F>;
  p.tile_bytes = F::tile_bytes(p.num_groups);
}

// half: the fp16 head (groups of 32 only: the formats without super-blocks, Q4_0 ... Q8_0, IQ4_NL).
template <int Bits, int Group, bool kMin>
inline void set_format(QuantPart& p, bool factored, bool half) {
  auto set = [&](auto fmt) { set_exact_format<decltype(fmt)>(p); };
  if (factored)
    set(Fmt<Bits, Group, kMin, true>{});
  else if constexpr (Group == 32)
    half ? set(Fmt<Bits, Group, kMin, false, true>{}) : set(Fmt<Bits, Group, kMin, false>{});
  else
    set(Fmt<Bits, Group, kMin, false>{});
}

// A quad format F (Q4QuadT, ByteQuad): its 8-bit path and its row lookup. p.super_acts: the layout's rounding of
// the activations (per super-block for a K-quant, unless flag kLayoutGroupActs), kept only where F has super-blocks.
template <class F>
inline void set_quad_format(QuantPart& p) {
  if constexpr (F::kPerSuper > 1)
    p.q8_rows = p.super_acts ? &q8_rows<F, true> : &q8_rows<F, false>;
  else
    p.q8_rows = &q8_rows<F, false>, p.super_acts = false;
  p.tile_weights = &tile_weights<F>;
  p.tile_bytes = F::tile_bytes(p.num_groups);
}

// kExact: the byte quads on the exact path (QuadExact), else on the 8-bit one.
template <int Group, bool kMin, bool kFactored, int kCodeBits, bool kHalf = false, bool kWide = false,
          bool kExact = false>
inline void set_byte_quad(QuantPart& p) {
  using Q = ByteQuad<Group, kMin, kFactored, kCodeBits, kHalf, kWide>;
  if constexpr (kExact)
    set_exact_format<QuadExact<Q>>(p);
  else
    set_quad_format<Q>(p);
}

template <int kCodeBits, bool kExact = false>
inline void set_byte_quads(QuantPart& p, int64_t group, bool has_min, bool factored, bool half) {
  constexpr int B = kCodeBits;
  constexpr bool E = kExact;
  if (half)  // groups of 32 (parse_quant_matrix checks)
    has_min ? set_byte_quad<32, true, false, B, true, false, E>(p)
            : set_byte_quad<32, false, false, B, true, false, E>(p);
  else if (group == 16)
    has_min ? (factored ? set_byte_quad<16, true, true, B, false, false, E>(p)
                        : set_byte_quad<16, true, false, B, false, false, E>(p))
            : (factored ? set_byte_quad<16, false, true, B, false, false, E>(p)
                        : set_byte_quad<16, false, false, B, false, false, E>(p));
  else
    has_min ? (factored ? set_byte_quad<32, true, true, B, false, false, E>(p)
                        : set_byte_quad<32, true, false, B, false, false, E>(p))
            : (factored ? set_byte_quad<32, false, true, B, false, false, E>(p)
                        : set_byte_quad<32, false, false, B, false, false, E>(p));
}

// data: uint8 [bytes]; meta: int64 [P, 9] as described at the top. Checks every part against the buffer.
inline QuantMatrix parse_quant_matrix(const torch::Tensor& data, const torch::Tensor& meta) {
  TORCH_CHECK(data.scalar_type() == torch::kUInt8 && data.dim() == 1 && data.is_contiguous() && !data.is_cuda(),
              "quantized weight data: contiguous uint8 CPU [bytes]");
  TORCH_CHECK(meta.scalar_type() == torch::kInt64 && meta.dim() == 2 && meta.size(1) == 9 && meta.size(0) > 0,
              "quantized weight meta: int64 [P, 9]");
  auto mt = meta.contiguous();
  const int64_t* m = mt.data_ptr<int64_t>();
  QuantMatrix q;
  q.first_tile.push_back(0);
  for (int64_t i = 0; i < mt.size(0); ++i, m += 9) {
    const int64_t offset = m[0], rows = m[1], k = m[2], bits = m[3], group = m[4], has_min = m[5], col = m[6];
    const bool half = (m[8] & kLayoutFp16Head) != 0, exact = (m[8] & kLayoutExactQuads) != 0;
    const bool group_acts = (m[8] & kLayoutGroupActs) != 0;
    const int64_t layout = m[8] & ~(kLayoutFp16Head | kLayoutExactQuads | kLayoutGroupActs);
    TORCH_CHECK(m[7] == kPanel, "part ", i, " was packed in tiles of ", m[7], " rows; this kernel build takes ",
                kPanel, " (pack with the loaded variant's panel_width)");
    TORCH_CHECK(rows > 0 && k > 0 && group > 0 && k % group == 0, "part ", i, ": rows and K a multiple of group");
    TORCH_CHECK(i == 0 || k == q.k, "every part has the same K");
    TORCH_CHECK(col == q.n, "part ", i, " must start at output row ", q.n);
    QuantPart p;
    p.rows = rows, p.col = col, p.num_groups = k / group, p.group = group;
    p.num_tiles = (rows + kPanel - 1) / kPanel;
    const bool six_bit = layout == 6 || layout == 7, five_bit = layout == 8 || layout == 9, wide = layout == 10;
    const int64_t code_bits = six_bit ? 6 : five_bit ? 5 : 8;
    const bool byte_quads = (layout == 3 || layout == 4 || six_bit || five_bit) && bits == code_bits &&
                            (group == 16 || group == 32) && k % 32 == 0;
    const bool wide_quads = wide && bits == 8 && group == 32 && !has_min;
    const bool nibble_quads = (layout == 1 || layout == 5) && bits == 4 && group == 32 && has_min;
    const bool factored = layout == 2 || layout == 4 || layout == 5 || layout == 7 || layout == 9;
    TORCH_CHECK(layout == 0 || (layout == 1 && nibble_quads) || (layout == 5 && nibble_quads && k % 256 == 0) ||
                    ((layout == 2 || layout == 4 || layout == 7 || layout == 9) && k % 256 == 0) || layout == 3 ||
                    layout == 6 || layout == 8 || wide_quads,
                "part ", i, ": layout ", layout,
                " (0: input-major; 1: quads, 4-bit groups of 32 with a min only; 2: factored, K a multiple of 256;"
                " 3, 4: byte quads of 8-bit groups of 16 or 32, K a multiple of 32, 4 factored as 2; 5: layout 1"
                " factored as 2; 6, 7: layouts 3 and 4 in six bits a code; 8, 9: in five bits; 10: wide byte quads,"
                " 8-bit groups of 32 without a min)");
    TORCH_CHECK(layout == 5 || layout < 3 || byte_quads || wide_quads, "part ", i, ": byte quads take ", code_bits,
                "-bit groups of 16 or 32, K a multiple of 32");
    TORCH_CHECK(!half || ((layout == 0 || layout == 1 || layout == 3 || layout == 6 || layout == 8 || wide) &&
                          group == 32),
                "part ", i, ": an fp16 head (layout flag ", kLayoutFp16Head,
                ") takes layouts 0, 1, 3, 6, 8 and 10, groups of 32");
    TORCH_CHECK(!exact || ((six_bit || five_bit) && byte_quads), "part ", i, ": flag ", kLayoutExactQuads,
                " (the exact path) takes layouts 6 to 9");
    TORCH_CHECK(!group_acts || (!exact && (layout == 4 || layout == 5 || layout == 7 || layout == 9)), "part ", i,
                ": flag ", kLayoutGroupActs, " (activations per group of 32) takes the factored quad layouts 4, 5, 7",
                " and 9");
    p.super_acts = factored && !group_acts;
    if (exact) {
      five_bit ? set_byte_quads<5, true>(p, group, has_min, factored, half)
               : set_byte_quads<6, true>(p, group, has_min, factored, half);
    } else if (nibble_quads) {
      factored ? set_quad_format<Q4QuadT<true>>(p)
               : (half ? set_quad_format<Q4QuadT<false, true>>(p) : set_quad_format<Q4Quad>(p));
    } else if (wide_quads) {
      half ? set_byte_quad<32, false, false, 8, true, true>(p) : set_byte_quad<32, false, false, 8, false, true>(p);
    } else if (byte_quads) {
      if (five_bit)
        set_byte_quads<5>(p, group, has_min, factored, half);
      else
        six_bit ? set_byte_quads<6>(p, group, has_min, factored, half)
                : set_byte_quads<8>(p, group, has_min, factored, half);
    } else if (bits == 4 && group == 32 && has_min)
      set_format<4, 32, true>(p, factored, half);
    else if (bits == 8 && group == 32 && !has_min)
      set_format<8, 32, false>(p, factored, half);
    else if (bits == 8 && group == 32 && has_min)
      set_format<8, 32, true>(p, factored, half);
    else if (bits == 8 && group == 16 && !has_min)
      set_format<8, 16, false>(p, factored, half);
    else if (bits == 8 && group == 16 && has_min)
      set_format<8, 16, true>(p, factored, half);
    else
      TORCH_CHECK(false, "part ", i, ": no block format with bits ", bits, ", group ", group, ", min ", has_min);
    TORCH_CHECK(offset >= 0 && offset + p.num_tiles * p.tile_bytes <= data.numel(), "part ", i,
                " runs past the data");
    p.data = data.data_ptr<uint8_t>() + offset;
    q.k = k, q.n += rows;
    if (p.q8_rows) (p.super_acts ? q.q8_super_acts : q.q8_group_acts) = true;
    q.parts.push_back(p);
    q.first_tile.push_back(q.first_tile.back() + p.num_tiles);
  }
  return q;
}


}  // namespace

// quant_linear_raw for a matrix with quad-layout parts: the activations rounded to 8 bits once (per group of 32,
// per super-block of 256 for the K-quants' parts, or both for a matrix of both), then every tile by its part's path
// (a Q8_0 part of a fused matrix stays exact), rows in blocks of ~256 KB of codes. `rows`: the activations'
// values (quantize_acts); x: the same as fp32 [M, K] for the exact parts (nullptr where every part is 8-bit).
template <class Rows>
inline void quant_linear_q8(const Rows& rows, const float* x, int64_t M, const QuantMatrix& w, float* y) {
  const int64_t K = w.k, N = w.n;
  const bool all_q8 = w.all_q8();
  TORCH_CHECK(x || all_q8, "an exact part needs the fp32 activations");
  thread_local Q8ActsBuffers per_group, per_super;
  const Q8Acts group_acts = w.q8_group_acts ? per_group.round(rows, M, K, Q4Quad::kGroup) : Q8Acts{};
  const Q8Acts super_acts = w.q8_super_acts ? per_super.round(rows, M, K, kMaxScaleGroup) : Q8Acts{};
  const int64_t block_rows = rows_per_block(kPanelRowBlockBytes, K, kQ8Rows);  // K bytes of codes a row
  const RowSums xsum(x, all_q8 ? 0 : M, K, block_rows);  // for the exact parts' small blocks
  // panel: an expanded tile of an exact part, for more than kQFusedRows rows
  parallel_tiles<std::vector<float>>(w.num_tiles(), M, block_rows, [&](auto& panel, int64_t t0, int64_t t1, int64_t m0,
                                                                        int64_t m1) {
    w.for_each_tile(t0, t1, [&](int64_t, const QuantPart& part, const uint8_t* tile, int64_t col, int64_t ncols) {
      if (part.q8_rows) {
        part.q8_rows(part.super_acts ? super_acts : group_acts, m0, m1, tile, y + col, N, ncols);
      } else {
        if (M > kQFusedRows && panel.size() < size_t(K * kPanel)) panel.resize(K * kPanel);
        part.tile_rows(x, xsum.data(), m0, m1, K, tile, part.num_groups, panel.data(), y + col, N, ncols);
      }
    });
  });
}

// quant_linear_raw for a wide K (a down projection: Qwen2.5-1.5B's 8,960 inputs) and more rows than fused_rows
// takes. Unchunked, a block of x rows that fits L2 is only a few rows there (K * 4 bytes each), so every block went
// through fused_rows and every tile was expanded again per 8 rows. Here K goes in pieces of kQChunkInputs: per
// block of rows (about kQTileBlockBytes of x per piece: 256 rows on AVX-512, 126 on AVX2, 60 on base), per piece,
// each tile's piece is expanded into an fp32 panel (kQChunkPanelBytes, L2-resident) and multiplied by every row of
// the block, the sums continuing from the last piece's (panel_block's kAccumulate): the depth's multiply-adds in the
// uncut order. A last block of at most kQFusedRows rows takes tile_rows (fused_rows, fused_row). Blocks of 1 MB of x
// rather than 256 KB (64 rows, each tile's piece expanded 16 times for 1,024 rows): the 1.5B's down projections at
// 512 and 1,024 rows 1.01-1.08x on AVX-512 and 1.02-1.10x on AVX2, alternated in one process (AMD EPYC family 26
// model 2, Zen 5, 2 threads, 2026-12-07).
constexpr int64_t kQChunkPanelBytes = 128 * 1024;
constexpr int64_t kQChunkInputs = std::max<int64_t>(256, kQChunkPanelBytes / (kPanel * 4) / 256 * 256);
constexpr int64_t kQChunkRows = panel_block_rows(kQTileBlockBytes, kQChunkInputs);

inline void quant_linear_chunked(const float* x, int64_t M, const QuantMatrix& w, float* y) {
  const int64_t K = w.k, N = w.n;
  const RowSums xsum(x, M, K, kQChunkRows);  // a last block small enough for fused_row(s)
  // panel: one tile's piece of K, expanded
  parallel_tiles<std::vector<float>>(w.num_tiles(), M, kQChunkRows, [&](auto& panel, int64_t t0, int64_t t1,
                                                                         int64_t m0, int64_t m1) {
    if (panel.size() < size_t(kQChunkInputs * kPanel)) panel.resize(kQChunkInputs * kPanel);
    const bool few = m1 - m0 <= kQFusedRows;
    for (int64_t k0 = 0; k0 < K; k0 += few ? K : kQChunkInputs) {
      const int64_t k1 = std::min(K, k0 + kQChunkInputs);
      w.for_each_tile(t0, t1, [&](int64_t, const QuantPart& part, const uint8_t* tile, int64_t col, int64_t ncols) {
        float* out = y + col;
        if (few) {
          part.tile_rows(x, xsum.data(), m0, m1, K, tile, part.num_groups, nullptr, out, N, ncols);
          return;
        }
        part.expand_groups(tile, k0 / part.group, k1 / part.group, panel.data());
        if (k0 == 0)
          panel_rows<false, false>(x, K, m0, m1, k1 - k0, panel.data(), out, N, ncols);
        else
          panel_rows<false, true>(x + k0, K, m0, m1, k1 - k0, panel.data(), out, N, ncols);
      });
    }
  });
}

// y [M, N] = x [M, K] @ W^T for a parsed quantized W; x and y contiguous.
// expand_once_bytes: the most bytes of fp32 panels a call expands once (kQExpandOnceBytes; the tests set it to reach
// both paths at small shapes).
inline void quant_linear_raw(const float* x, int64_t M, const QuantMatrix& w, float* y,
                             int64_t expand_once_bytes = kQExpandOnceBytes) {
  if (M == 0) return;
  const int64_t K = w.k, N = w.n;
  const int64_t block_rows = panel_block_rows(kPanelRowBlockBytes, K);
  if (w.has_q8()) {
    quant_linear_q8(DenseRows{x, K}, x, M, w, y);
    return;
  }
  if (M > kQFusedRows && block_rows <= std::max(kQFusedRows, kPanelMaxRows) && K > kQChunkInputs) {
    quant_linear_chunked(x, M, w, y);  // a wide K: each tile would be expanded again for every block of few rows
    return;
  }
  const int64_t tile_block_rows = panel_block_rows(kQTileBlockBytes, K);
  const RowSums xsum(x, M, K, tile_block_rows);  // the tile-by-tile path's blocks (the other needs no sums)
  const int64_t tile_floats = K * kPanel;
  if (M > block_rows && w.num_tiles() * tile_floats * int64_t(sizeof(float)) <= expand_once_bytes) {
    // More than one block of rows: every tile expanded once, then the blocks of rows go through the expanded tiles
    // as panel_linear's go through its panels. The calling thread's buffer, kept across calls: a fresh multi-MB
    // buffer per call cost its page faults (~8% at 1,024 rows)
    thread_local std::vector<float> panels;
    if (panels.size() < size_t(w.num_tiles() * tile_floats)) panels.resize(w.num_tiles() * tile_floats);
    float* expanded = panels.data();
    parallel_runs<NoState>(w.num_tiles(), [&](NoState&, int64_t t0, int64_t t1) {
      w.for_each_tile(t0, t1, [&](int64_t t, const QuantPart& part, const uint8_t* tile, int64_t, int64_t) {
        part.expand_panel(tile, part.num_groups, expanded + t * tile_floats);
      });
    });
    parallel_tiles<NoState>(w.num_tiles(), M, block_rows, [&](NoState&, int64_t t0, int64_t t1, int64_t m0,
                                                              int64_t m1) {
      w.for_each_tile(t0, t1, [&](int64_t t, const QuantPart&, const uint8_t*, int64_t col, int64_t ncols) {
        panel_rows<true>(x, K, m0, m1, K, expanded + t * tile_floats, y + col, N, ncols);
      });
    });
    return;
  }
  // panel: an expanded tile (prefill only)
  parallel_tiles<std::vector<float>>(w.num_tiles(), M, tile_block_rows, [&](auto& panel, int64_t t0, int64_t t1,
                                                                             int64_t m0, int64_t m1) {
    if (M > kQFusedRows && panel.size() < size_t(K * kPanel)) panel.resize(K * kPanel);
    w.for_each_tile(t0, t1, [&](int64_t, const QuantPart& part, const uint8_t* tile, int64_t col, int64_t ncols) {
      part.tile_rows(x, xsum.data(), m0, m1, K, tile, part.num_groups, panel.data(), y + col, N, ncols);
    });
  });
}

inline int64_t quant_tile_rows() { return kPanel; }

// silu(gate) * up of gate_up [M, 2K] (gate | up), made a span at a time by silu_mul's arithmetic
struct SiluRows {
  const float* gate_up;
  int64_t K;
  const float* values(int64_t m, int64_t k0, int64_t n, float* buf) const {
    const float* row = gate_up + m * 2 * K;
    silu_mul_row(row + k0, row + K + k0, n, buf);
    return buf;
  }
};

// x [M, K] fp32; data uint8 [bytes]; meta int64 [P, 9] -> y [M, N] fp32 (N: the parts' rows together);
// expand_once_bytes < 0: the built-in limit.
inline torch::Tensor quant_linear(torch::Tensor x, torch::Tensor data, torch::Tensor meta,
                                  int64_t expand_once_bytes = -1) {
  const QuantMatrix w = parse_quant_matrix(data, meta);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && !x.is_cuda(), "x: fp32 CPU [M, K]");
  TORCH_CHECK(x.size(1) == w.k, "x has ", x.size(1), " features, the weight ", w.k);
  x = x.contiguous();
  auto y = torch::empty({x.size(0), w.n}, x.options());
  quant_linear_raw(x.data_ptr<float>(), x.size(0), w, y.data_ptr<float>(),
                   expand_once_bytes < 0 ? kQExpandOnceBytes : expand_once_bytes);
  return y;
}

// gate_up [M, 2K] (gate | up) -> (silu(gate) * up) @ W^T, as silu_mul then quant_linear, bit for bit. Where every
// part of W takes 8-bit activations the product is rounded to codes as it is made, a span of inputs at a time,
// never stored as fp32 [M, K] and read back (a 512-row chunk of Qwen2.5-1.5B's MLP: 18 MB written and read).
inline torch::Tensor quant_linear_silu(torch::Tensor gate_up, torch::Tensor data, torch::Tensor meta) {
  const QuantMatrix w = parse_quant_matrix(data, meta);
  check_fp32_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) == 2 * w.k, "gate_up has ", gate_up.size(1), " columns, the weight ", w.k,
              " features (gate | up: twice that)");
  const int64_t M = gate_up.size(0);
  auto y = torch::empty({M, w.n}, gate_up.options());
  if (M > 0 && w.all_q8()) {
    quant_linear_q8(SiluRows{gate_up.data_ptr<float>(), w.k}, nullptr, M, w, y.data_ptr<float>());
  } else {  // the matrix parsed once: the exact path's every MLP call comes this way
    const auto hidden = silu_mul(gate_up);
    quant_linear_raw(hidden.data_ptr<float>(), M, w, y.data_ptr<float>());
  }
  return y;
}

// The fp32 rows `ids` [n] of W -> [n, K]: an embedding lookup in a quantized table (and the tests' dequantize).
inline torch::Tensor quant_rows(torch::Tensor data, torch::Tensor meta, torch::Tensor ids) {
  const QuantMatrix w = parse_quant_matrix(data, meta);
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.dim() == 1, "ids: int64 [n]");
  auto ids_c = ids.contiguous();
  const int64_t* id = ids_c.data_ptr<int64_t>();
  const int64_t n = ids_c.numel();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < w.n, "row id ", id[i], " out of range");
  auto out = torch::empty({n, w.k}, torch::TensorOptions().dtype(torch::kFloat32));
  float* o = out.data_ptr<float>();
  const QuantMatrix* wp = &w;
  at::parallel_for(0, n, 64, [=](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      size_t p = 0;
      while (id[i] >= wp->parts[p].col + wp->parts[p].rows) ++p;
      const QuantPart& part = wp->parts[p];
      const int64_t r = id[i] - part.col;
      part.tile_weights(part.data + (r / kPanel) * part.tile_bytes, part.num_groups, r % kPanel, o + i * wp->k);
    }
  });
  return out;
}
