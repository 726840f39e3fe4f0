// fp32 linear layers on CPU at every batch size: y [M, N] = x [M, K] @ W [N, K]^T, W stored as column panels.
//
// Packing: W [N, K] -> panels [P, K, kPanel], P = ceil(N / kPanel), kPanel = 2 vectors (32 columns on AVX-512,
// 16 on AVX2, 8 on base), panel p holding output columns kPanel*p .. kPanel*p+kPanel-1 for each k in turn
// (zero-padded past N). One kernel then serves decode and prefill:
// - each thread owns a contiguous run of panels and reads it once from memory, in storage order, with a
//   software prefetch 16 KB ahead into L2 (what a decode step of a few rows is bound by);
// - within a panel, the rows go in near-equal chunks of at most kPanelMaxRows (8 on AVX-512, 6 on AVX2: 2 x rows
//   accumulators, two weight vectors and a broadcast within the 32 or 16 vector registers): per k two vector
//   loads of the panel and one broadcast per row feed 2 x rows FMAs (an outer product, no horizontal sums), and
//   the panel (K x kPanel floats, L2-resident) is reused by every chunk;
// - many rows (prefill) go in blocks of ~256 KB of x, each through all of a thread's panels, and the k loop is
//   unrolled 4 times: together +10-20% at 1,024 rows (AVX2 200 -> 230-250 GFLOP/s of a 265 peak, AVX-512 340
//   -> 370-440 of 490, on the KVM Xeon of 2026-12-01, 2 threads).
// Measured on AVX-512 against oneDNN with its own packed weights (benchmarks/bench_linear.py, 2 threads, the 120
// projections of SmolLM2-135M cycled from memory): 13.0 vs 21.5 ms at 1 row, 14.4 vs 21.7 at 8, 22.4 vs 25.6
// at 16, 52.4 vs 63.6 at 48, 67.9 vs 76.6 at 64, and within 3% either way at 512-2,048 rows.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "simd.h"
#include "work_units.h"

namespace {

constexpr int64_t kPanel = 2 * simd::kLanes;                           // output columns per panel
constexpr int kPanelMaxRows = std::min(8, (simd::kNumRegs - 3) / 2);   // rows per register block
constexpr int64_t kPanelPrefetchBytes = 16384;
// x rows per block of panel_linear: 256 KB fits the L2 of every x86 core we know of (Zen 2/3: 512 KB). Blocks of
// 40 to 220 rows measured alike (within 5%) on an AVX-512 Xeon with 2 MB of L2; all 1,024 rows at once, 8% slower.
constexpr int64_t kPanelRowBlockBytes = 256 * 1024;

// The rows of a block of about `bytes` of rows `row_bytes` each: a multiple of `multiple`, at least one.
constexpr int64_t rows_per_block(int64_t bytes, int64_t row_bytes, int64_t multiple) {
  return std::max<int64_t>(multiple, bytes / row_bytes / multiple * multiple);
}
// ... of fp32 x rows K wide, in register blocks of kPanelMaxRows
constexpr int64_t panel_block_rows(int64_t bytes, int64_t K) {
  return rows_per_block(bytes, K * int64_t(sizeof(float)), kPanelMaxRows);
}

// One output row of a panel's width: the two vectors lo, hi at c[0:kPanel], or their first ncols lanes.
inline void store_panel_row(float* c, simd::Vec lo, simd::Vec hi, int64_t ncols) {
  using namespace simd;
  if (ncols == kPanel) {
    store(c, lo), store(c + kLanes, hi);
  } else {
    const int n0 = static_cast<int>(std::min<int64_t>(ncols, kLanes));
    store_n(c, lo, n0), store_n(c + kLanes, hi, static_cast<int>(ncols) - n0);
  }
}

// c[r][0:ncols] = sum_d a[r * lda + d] * b[d * ldb + 0:kPanel] for r < R: one register block of an
// outer-product matmul (b is a panel; ncols <= kPanel of it are stored). kPrefetch: also prefetch b 16 KB ahead
// into L2, for panels read from memory (panel_linear); attention_prefill.h uses it on panels already in cache.
// kAccumulate: c += the sum instead, the sum's multiply-adds continuing from c's values (a depth cut in pieces,
// each piece accumulating onto the last, gives the uncut depth's result bit for bit).
template <int R, bool kPrefetch, bool kAccumulate = false>
inline void panel_block(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t depth, float* c,
                        int64_t ldc, int64_t ncols) {
  using namespace simd;
  Vec lo[R], hi[R];
  if constexpr (kAccumulate) {
    const int n0 = static_cast<int>(std::min<int64_t>(ncols, kLanes));
    for (int r = 0; r < R; ++r)
      lo[r] = load_n(c + r * ldc, n0), hi[r] = load_n(c + r * ldc + kLanes, static_cast<int>(ncols) - n0);
  } else {
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = zero();
  }
#pragma GCC unroll 4
  for (int64_t d = 0; d < depth; ++d) {  // unrolled: the loop's own count and branch cost ~15% at 6 and 8 rows
    if constexpr (kPrefetch) prefetch_l2(reinterpret_cast<const char*>(b + d * ldb) + kPanelPrefetchBytes);
    const Vec w0 = load(b + d * ldb), w1 = load(b + d * ldb + kLanes);
    for (int r = 0; r < R; ++r) {
      const Vec x = set1(a[r * lda + d]);
      lo[r] = fmadd(x, w0, lo[r]);
      hi[r] = fmadd(x, w1, hi[r]);
    }
  }
  for (int r = 0; r < R; ++r) store_panel_row(c + r * ldc, lo[r], hi[r], ncols);
}

// panel_block for a run-time number of rows, 1 <= rows <= R
template <int R, bool kPrefetch, bool kAccumulate = false>
inline void panel_block_n(int rows, const float* a, int64_t lda, const float* b, int64_t ldb, int64_t depth, float* c,
                          int64_t ldc, int64_t ncols) {
  if constexpr (R >= 1) {
    if (rows == R) return panel_block<R, kPrefetch, kAccumulate>(a, lda, b, ldb, depth, c, ldc, ncols);
    panel_block_n<R - 1, kPrefetch, kAccumulate>(rows, a, lda, b, ldb, depth, c, ldc, ncols);
  }
}

}  // namespace

// y [M, N] = x [M, K] @ W^T from panels [P, K, kPanel]; x, y contiguous.
inline void panel_linear_raw(const float* x, int64_t M, int64_t K, const float* panels, int64_t N, float* y) {
  if (M == 0 || N == 0) return;
  const int64_t P = (N + kPanel - 1) / kPanel;
  // Rows go in blocks of about kPanelRowBlockBytes of x, each block through all of a thread's panels, so the
  // block stays in L2 while the panels stream past (a decode step is one block).
  const int64_t block_rows = panel_block_rows(kPanelRowBlockBytes, K);
  parallel_tiles<NoState>(P, M, block_rows, [&](NoState&, int64_t p0, int64_t p1, int64_t m0, int64_t m1) {
    const int64_t num_chunks = (m1 - m0 + kPanelMaxRows - 1) / kPanelMaxRows;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t ncols = std::min(kPanel, N - p * kPanel);
      const float* panel = panels + p * K * kPanel;
      int64_t m = m0;
      for (int64_t c = 0; c < num_chunks; ++c) {
        const int64_t rows = (m1 - m) / (num_chunks - c);  // near-equal chunks of at most kPanelMaxRows
        panel_block_n<kPanelMaxRows, true>(static_cast<int>(rows), x + m * K, K, panel, kPanel, K,
                                           y + m * N + p * kPanel, N, ncols);
        m += rows;
      }
    }
  });
}

// weight [N, K] fp32 -> panels [ceil(N / kPanel), K, kPanel] fp32
inline torch::Tensor pack_panels(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32 && !weight.is_cuda(),
              "weight: fp32 CPU [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kPanel - 1) / kPanel;
  auto w = weight.contiguous();
  auto out = torch::zeros({P, K, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t n = p * kPanel; n < std::min(N, (p + 1) * kPanel); ++n)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kPanel + n % kPanel] = src[n * K + k];
  });
  return out;
}

// x [M, K] fp32; panels [P, K, kPanel] from pack_panels; N output features (P = ceil(N / kPanel)) -> y [M, N]
inline int64_t panel_width() { return kPanel; }

inline torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && !x.is_cuda(), "x: fp32 CPU [M, K]");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == torch::kFloat32 && panels.size(2) == kPanel &&
                  panels.is_contiguous(),
              "panels: contiguous fp32 [P, K, ", kPanel, "] from pack_panels");
  TORCH_CHECK(panels.size(1) == x.size(1), "x has ", x.size(1), " features, the weight ", panels.size(1));
  TORCH_CHECK(N > 0 && (N + kPanel - 1) / kPanel == panels.size(0), "N does not match the panels");
  x = x.contiguous();
  auto y = torch::empty({x.size(0), N}, x.options());
  panel_linear_raw(x.data_ptr<float>(), x.size(0), x.size(1), panels.data_ptr<float>(), N, y.data_ptr<float>());
  return y;
}
