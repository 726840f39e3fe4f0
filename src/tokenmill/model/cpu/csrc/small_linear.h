// int8 linear layers on CPU: y [M, N] = (x [M, K] @ W [N, K]^T) * scale[n], W int8 with one fp32 scale per output
// row, at every batch size (fp32 weights go through panel_linear.h).
//
// A decode step is bound by reading W from memory, so the loop nest reads W exactly once, in storage order: each
// thread takes a contiguous band of output rows, and for each tile of 4 weight rows (L1-resident) it runs every
// group of up to 4 input rows, with a software prefetch one tile ahead.
//
// Converting each weight to fp32 for an FMA (3 instructions per 16 weights) made the kernel compute-bound at
// ~13-16 GB/s. Instead the input rows are rounded once per call to int16 fixed point (one scale per row,
// max|x| / 32767: an absolute error of at most 1.5e-5 of the row's largest magnitude; on the small elements of a
// row with outliers that can exceed bf16's relative rounding, and int8_quality.py puts the whole path at +0.0058
// nats/token against torch's bf16-input kernel's +0.0033), and the weights are sign-extended to int16 as they
// load. The products then go through simd.h's dot_i16: VNNI's vpdpwssd on AVX-512 (32 int16 pairs per
// instruction into int32 lanes), vpmaddwd + vpaddd on AVX2 (16 pairs), a plain loop on base. Exact integer sums,
// one float conversion at the end (or every 256 steps, so no lane can overflow: a lane takes 2 products per step,
// 512 per flush, and 512 x 32767 x 128 < 2^31).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

constexpr int kTileN = 4;                            // weight rows per tile
constexpr int kTileM = simd::kNumRegs >= 32 ? 4 : 2;  // input rows per pass over a tile (kTileM x kTileN sums)
#ifndef TOKENMILL_PREFETCH_BYTES
#define TOKENMILL_PREFETCH_BYTES 32768
#endif
// Software prefetch distance into L2, ahead of the weight bytes being read (a band is one contiguous run). The
// hardware prefetchers alone kept too few lines in flight: int8 read ~17 GB/s from memory against ~39 GB/s
// from L3; prefetching 32 KB ahead into L2 took it to ~27 GB/s (1 row, 2 threads; 2-4 KB ahead into L1 did
// nothing measurable).
constexpr int64_t kPrefetchBytes = TOKENMILL_PREFETCH_BYTES;

// Input rows of an int8 matmul as int16 fixed point: x[m, k] ~= q[m * ld + k] * row_scale[m]; ld >= K, zero-padded.
struct QuantizedRows {
  std::vector<int16_t> q;
  std::vector<float> row_scale;
  int64_t ld = 0;
};

inline QuantizedRows quantize_rows_int16(const float* x, int64_t M, int64_t K) {
  QuantizedRows r;
  r.ld = (K + simd::kDotInputs - 1) / simd::kDotInputs * simd::kDotInputs;
  r.q.assign(M * r.ld, 0);
  r.row_scale.resize(M);
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(xm[k]));
    const float s = amax > 0.f ? amax / 32767.f : 1.f;
    const float inv = 1.f / s;
    r.row_scale[m] = s;
    int16_t* qm = r.q.data() + m * r.ld;
    for (int64_t k = 0; k < K; ++k)
      qm[k] = static_cast<int16_t>(std::max(-32767.f, std::min(32767.f, std::nearbyint(xm[k] * inv))));
  }
  return r;
}

// One step of tile_i8: inputs [k, k + kDotInputs) (the weights' last n of a row when kTail).
template <int MT, int NT, bool kTail>
inline void step_i8(const QuantizedRows& xq, int64_t m0, int64_t K, const int8_t* w, int64_t k, int n,
                    simd::IVec (&acc)[MT][NT]) {
  using namespace simd;
  IVec xv[MT];
  for (int i = 0; i < MT; ++i) xv[i] = load_i16(xq.q.data() + (m0 + i) * xq.ld + k);  // zero-padded rows
  for (int j = 0; j < NT; ++j) {
    const int8_t* w_row = w + j * K + k;
    prefetch_l2(reinterpret_cast<const char*>(w_row) + kPrefetchBytes);  // see kPrefetchBytes
    const IVec wv = kTail ? load_i8_as_i16_n(w_row, n) : load_i8_as_i16(w_row);
    for (int i = 0; i < MT; ++i) acc[i][j] = dot_i16(acc[i][j], xv[i], wv);
  }
}

// y[i][j] = (x row m0 + i) . (w row j) * scales, for an MT x NT tile: every weight read once per tile.
template <int MT, int NT>
inline void tile_i8(const QuantizedRows& xq, int64_t m0, int64_t K, const int8_t* w, const float* scale, float* y,
                    int64_t ldy) {
  using namespace simd;
  constexpr int64_t kFlush = 256 * kDotInputs;  // inputs per int32 accumulation (no overflow: see the top)
  float sums[MT][NT] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kFlush) {
    const int64_t k1 = std::min(K, k0 + kFlush);
    IVec acc[MT][NT];
    for (int i = 0; i < MT; ++i)
      for (int j = 0; j < NT; ++j) acc[i][j] = izero();
    int64_t k = k0;
    for (; k + kDotInputs <= k1; k += kDotInputs) step_i8<MT, NT, false>(xq, m0, K, w, k, kDotInputs, acc);
    if (k < k1) step_i8<MT, NT, true>(xq, m0, K, w, k, static_cast<int>(k1 - k), acc);
    for (int i = 0; i < MT; ++i)
      for (int j = 0; j < NT; ++j) sums[i][j] += reduce_add_i32(acc[i][j]);
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) y[i * ldy + j] = sums[i][j] * xq.row_scale[m0 + i] * scale[j];
}

// One tile of NT weight rows against every input row, up to kTileM at a time.
template <int NT>
inline void tile_rows_i8(const QuantizedRows& xq, int64_t M, int64_t K, const int8_t* w, const float* scale,
                         float* y, int64_t N) {
  int64_t m = 0;
  for (; m + kTileM <= M; m += kTileM) tile_i8<kTileM, NT>(xq, m, K, w, scale, y + m * N, N);
  switch (M - m) {
    case 3: tile_i8<3, NT>(xq, m, K, w, scale, y + m * N, N); break;
    case 2: tile_i8<2, NT>(xq, m, K, w, scale, y + m * N, N); break;
    case 1: tile_i8<1, NT>(xq, m, K, w, scale, y + m * N, N); break;
    default: break;
  }
}

// Output rows [n0, n1) of y.
inline void band_i8(const QuantizedRows& xq, int64_t M, int64_t K, const int8_t* w, const float* scale, float* y,
                    int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kTileN <= n1; n += kTileN) tile_rows_i8<kTileN>(xq, M, K, w + n * K, scale + n, y + n, N);
  for (; n < n1; ++n) tile_rows_i8<1>(xq, M, K, w + n * K, scale + n, y + n, N);
}

}  // namespace

// y [M, N] = x [M, K] @ w [N, K]^T (w int8 when scale != nullptr, then times scale[n]); all contiguous.
inline void small_linear_raw(const float* x, int64_t M, int64_t K, const int8_t* w, const float* scale, float* y,
                             int64_t N) {
  if (M == 0 || N == 0) return;
  const QuantizedRows xq = quantize_rows_int16(x, M, K);
  // Bands of whole tiles; a band of at least 16 tiles so tiny layers are not split into wake-up-bound slivers.
  const int64_t num_tiles = (N + kTileN - 1) / kTileN;
  at::parallel_for(0, num_tiles, 16, [&](int64_t t0, int64_t t1) {
    band_i8(xq, M, K, w, scale, y, N, t0 * kTileN, std::min(N, t1 * kTileN));
  });
}

// x [M, K] fp32; weight [N, K] int8; scale [N] fp32 -> y [M, N] fp32.
inline torch::Tensor small_linear(torch::Tensor x, torch::Tensor weight, torch::Tensor scale) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "shapes: x [M, K], weight [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "x must be float32");
  TORCH_CHECK(!x.is_cuda() && !weight.is_cuda(), "CPU tensors only");
  TORCH_CHECK(weight.scalar_type() == torch::kInt8, "weight must be int8 (fp32 weights: panel_linear)");
  auto s = scale.contiguous();
  TORCH_CHECK(s.scalar_type() == torch::kFloat32 && s.numel() == weight.size(0), "scale: float32 [N]");
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  auto y = torch::empty({M, N}, x.options());
  small_linear_raw(x.data_ptr<float>(), M, K, weight.data_ptr<int8_t>(), s.data_ptr<float>(), y.data_ptr<float>(), N);
  return y;
}
