// LoRA deltas of a step's rows, each row through its own adapter (model/lora.py's slots): out[t] += B_s (A_s x[t])
// for the slot s of row t (none: -1, the row is left alone). Rows that use adapters and rows that do not share one
// batch, and each row reads only its own adapter (Punica's grouped form, not a dense product over every slot).
//
//   a [S * P * R, K]  slot s's A: rows (s * P + i) * R .. + R for part i of the projection (q, k, v of a fused qkv)
//   b [S, R, N]       slot s's B, transposed: b[s][j][n] multiplies h[i * R + j] where output n lies in part i
//   part_starts       P + 1 output boundaries (0, then the end of each part: the fused projection's row ranges)
//
// Consecutive rows with the same slot (a prompt's chunk) go in blocks of up to kLoraRows, so a block reads its
// adapter's A and B once: h = A_s x for the block's rows (a dot product per rank row, the block's rows sharing each
// load of A), then per part, per vector of outputs, out += sum_j h[i * R + j] * b[s][j][outputs].
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

constexpr int kLoraRows = simd::kNumRegs >= 32 ? 8 : 4;  // rows of a block: one accumulator each in the A pass

struct LoraBlock {
  int64_t row, rows, slot;
};

// h[r * PR + j] = x[row0 + r] . A_s[j] for the block's rows
template <int Rows>
inline void lora_down(const float* x, int64_t K, const float* as, int64_t PR, float* h) {
  using namespace simd;
  for (int64_t j = 0; j < PR; ++j) {
    Vec acc[Rows];
    for (int r = 0; r < Rows; ++r) acc[r] = zero();
    const float* aj = as + j * K;
    for (int64_t k = 0; k < K; k += kLanes) {
      const int n = static_cast<int>(std::min<int64_t>(kLanes, K - k));
      const Vec av = load_n(aj + k, n);
      for (int r = 0; r < Rows; ++r) acc[r] = fmadd(load_n(x + r * K + k, n), av, acc[r]);
    }
    for (int r = 0; r < Rows; ++r) h[r * PR + j] = reduce_add(acc[r]);
  }
}

template <int Rows>
inline void lora_down_n(int rows, const float* x, int64_t K, const float* as, int64_t PR, float* h) {
  if constexpr (Rows >= 1) {
    if (rows == Rows) return lora_down<Rows>(x, K, as, PR, h);
    lora_down_n<Rows - 1>(rows, x, K, as, PR, h);
  }
}

// out[row0 + r][n] += sum_j h[r * PR + i * R + j] * bs[j * N + n], n in part i, for the block's rows
inline void lora_up(const float* h, int rows, int64_t PR, int64_t R, const float* bs, int64_t N,
                    const std::vector<int64_t>& part_starts, float* out) {
  using namespace simd;
  for (size_t i = 0; i + 1 < part_starts.size(); ++i) {
    for (int64_t n0 = part_starts[i]; n0 < part_starts[i + 1]; n0 += kLanes) {
      const int cnt = static_cast<int>(std::min<int64_t>(kLanes, part_starts[i + 1] - n0));
      for (int r = 0; r < rows; ++r) {
        float* o = out + r * N + n0;
        const float* hr = h + r * PR + static_cast<int64_t>(i) * R;
        Vec acc = load_n(o, cnt);
        for (int64_t j = 0; j < R; ++j) acc = fmadd(set1(hr[j]), load_n(bs + j * N + n0, cnt), acc);
        store_n(o, acc, cnt);
      }
    }
  }
}

// x [T, K], out [T, N] fp32 (out updated in place), a [S * P * R, K], b [S, R, N] fp32, slots [T] int64 (-1: none).
inline void lora_add_(torch::Tensor x, torch::Tensor out, torch::Tensor a, torch::Tensor b, torch::Tensor slots,
                      std::vector<int64_t> part_starts) {
  auto fp32_2d = [](const torch::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.dim() == 2 && t.is_contiguous() && !t.is_cuda(), name,
                ": contiguous fp32 CPU matrix");
  };
  fp32_2d(x, "x"), fp32_2d(out, "out"), fp32_2d(a, "a");
  TORCH_CHECK(b.scalar_type() == torch::kFloat32 && b.dim() == 3 && b.is_contiguous() && !b.is_cuda(),
              "b: contiguous fp32 CPU [S, R, N]");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.dim() == 1 && slots.is_contiguous(), "slots: int64 [T]");
  const int64_t T = x.size(0), K = x.size(1), N = out.size(1), S = b.size(0), R = b.size(1);
  const int64_t P = static_cast<int64_t>(part_starts.size()) - 1;
  TORCH_CHECK(P >= 1 && part_starts.front() == 0 && part_starts.back() == N, "part_starts: 0 .. N");
  for (int64_t i = 0; i < P; ++i) TORCH_CHECK(part_starts[i] < part_starts[i + 1], "part_starts must increase");
  TORCH_CHECK(out.size(0) == T && slots.size(0) == T, "x, out and slots: one row per token");
  TORCH_CHECK(b.size(2) == N && a.size(0) == S * P * R && a.size(1) == K, "a [S * P * R, K] and b [S, R, N]");
  const int64_t* slot = slots.data_ptr<int64_t>();
  std::vector<LoraBlock> blocks;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slot[t] >= -1 && slot[t] < S, "slot ", slot[t], " of row ", t, " outside -1 .. ", S - 1);
    if (slot[t] < 0) continue;
    if (!blocks.empty() && blocks.back().slot == slot[t] && blocks.back().row + blocks.back().rows == t &&
        blocks.back().rows < kLoraRows)
      ++blocks.back().rows;
    else
      blocks.push_back({t, 1, slot[t]});
  }
  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t PR = P * R;
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> h(kLoraRows * PR);
    for (int64_t i = b0; i < b1; ++i) {
      const LoraBlock& blk = blocks[i];
      const int rows = static_cast<int>(blk.rows);
      lora_down_n<kLoraRows>(rows, xp + blk.row * K, K, ap + blk.slot * PR * K, PR, h.data());
      lora_up(h.data(), rows, PR, R, bp + blk.slot * R * N, N, part_starts, op + blk.row * N);
    }
  });
}

}  // namespace
