// LoRA deltas of a step's rows, each row through its own adapter (model/lora.py's slots): out[t] += B_s (A_s x[t])
// for the slot s of row t (none: -1, the row is left alone). Rows that use adapters and rows that do not share one
// batch, and each row reads only its own adapter (Punica's grouped form, not a dense product over every slot).
//
//   a [S * P * R, K]  slot s's A: rows (s * P + i) * R .. + R for part i of the projection (q, k, v of a fused qkv)
//   b [S, R, N]       slot s's B, transposed: b[s][j][n] multiplies h[i * R + j] where output n lies in part i
//   part_starts       P + 1 output boundaries (0, then the end of each part: the fused projection's row ranges)
//
// A slot's rows (wherever they sit in the batch: a prompt's chunk, or one decode row per request) go in blocks of up
// to kLoraRows, so a block reads its adapter's A and B once: h = A_s x for the block's rows (a dot product per rank
// row, every row sharing each load of A), then per part, per vector of outputs, out += sum_j h[i * R + j] *
// b[s][j][outputs] (every row sharing each load of B).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

constexpr int kLoraRows = simd::kNumRegs >= 32 ? 8 : 4;  // rows of a block: one accumulator each

struct LoraBlock {
  int64_t slot, rows;
  int64_t row[kLoraRows];  // the block's rows of x and out (a slot's rows, wherever they sit in the batch)
};

constexpr int kLoraCols = 2;  // rank rows of A (in lora_down) and output vectors (in lora_up) per register block

// h[r * PR + j] = x[row r] . A_s[j] for the block's rows, kLoraCols rank rows at a time: each load of A serves
// every row, each load of x kLoraCols rank rows (PR is a multiple of the rank: even whenever it exceeds 1)
template <int Rows>
inline void lora_down(const float* x, int64_t K, const LoraBlock& blk, const float* as, int64_t PR, float* h) {
  using namespace simd;
  for (int64_t j0 = 0; j0 < PR; j0 += kLoraCols) {
    const int cols = static_cast<int>(std::min<int64_t>(kLoraCols, PR - j0));
    Vec acc[kLoraCols][Rows];
    for (int c = 0; c < kLoraCols; ++c)
      for (int r = 0; r < Rows; ++r) acc[c][r] = zero();
    for (int64_t k = 0; k < K; k += kLanes) {
      const int n = static_cast<int>(std::min<int64_t>(kLanes, K - k));
      Vec av[kLoraCols];
      for (int c = 0; c < kLoraCols; ++c) av[c] = c < cols ? load_n(as + (j0 + c) * K + k, n) : zero();
      for (int r = 0; r < Rows; ++r) {
        const Vec xv = load_n(x + blk.row[r] * K + k, n);
        for (int c = 0; c < kLoraCols; ++c) acc[c][r] = fmadd(xv, av[c], acc[c][r]);
      }
    }
    for (int c = 0; c < cols; ++c)
      for (int r = 0; r < Rows; ++r) h[r * PR + j0 + c] = reduce_add(acc[c][r]);
  }
}

// out[row r][n] += sum_j h[r * PR + i * R + j] * bs[j * N + n], n in part i, kLoraCols vectors of outputs at a
// time: each load of B serves every row, each broadcast of h kLoraCols vectors
template <int Rows>
inline void lora_up(float* out, int64_t N, const LoraBlock& blk, const float* h, int64_t PR, int64_t R,
                    const float* bs, const std::vector<int64_t>& part_starts) {
  using namespace simd;
  constexpr int64_t kStep = kLoraCols * kLanes;
  for (size_t i = 0; i + 1 < part_starts.size(); ++i) {
    const float* hi = h + static_cast<int64_t>(i) * R;
    for (int64_t n0 = part_starts[i]; n0 < part_starts[i + 1]; n0 += kStep) {
      int cnt[kLoraCols];
      for (int c = 0; c < kLoraCols; ++c)
        cnt[c] = static_cast<int>(std::clamp<int64_t>(part_starts[i + 1] - n0 - c * kLanes, 0, kLanes));
      Vec acc[kLoraCols][Rows];
      for (int c = 0; c < kLoraCols; ++c)
        for (int r = 0; r < Rows; ++r) acc[c][r] = load_n(out + blk.row[r] * N + n0 + c * kLanes, cnt[c]);
      for (int64_t j = 0; j < R; ++j) {
        Vec bv[kLoraCols];
        for (int c = 0; c < kLoraCols; ++c) bv[c] = load_n(bs + j * N + n0 + c * kLanes, cnt[c]);
        for (int r = 0; r < Rows; ++r) {
          const Vec hv = set1(hi[r * PR + j]);
          for (int c = 0; c < kLoraCols; ++c) acc[c][r] = fmadd(hv, bv[c], acc[c][r]);
        }
      }
      for (int c = 0; c < kLoraCols; ++c)
        for (int r = 0; r < Rows; ++r) store_n(out + blk.row[r] * N + n0 + c * kLanes, acc[c][r], cnt[c]);
    }
  }
}

template <int Rows>
inline void lora_block(const float* x, int64_t K, float* out, int64_t N, const LoraBlock& blk, const float* as,
                       const float* bs, int64_t PR, int64_t R, const std::vector<int64_t>& part_starts, float* h) {
  if constexpr (Rows >= 1) {
    if (blk.rows != Rows) return lora_block<Rows - 1>(x, K, out, N, blk, as, bs, PR, R, part_starts, h);
    lora_down<Rows>(x, K, blk, as, PR, h);
    lora_up<Rows>(out, N, blk, h, PR, R, bs, part_starts);
  }
}

// The step's rows by slot, in blocks of up to kLoraRows (a slot's rows in batch order; rows without one skipped).
inline std::vector<LoraBlock> lora_blocks(const int64_t* slot, int64_t T, int64_t S) {
  std::vector<std::vector<int64_t>> rows(S);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slot[t] >= -1 && slot[t] < S, "slot ", slot[t], " of row ", t, " outside -1 .. ", S - 1);
    if (slot[t] >= 0) rows[slot[t]].push_back(t);
  }
  std::vector<LoraBlock> blocks;
  for (int64_t s = 0; s < S; ++s)
    for (size_t first = 0; first < rows[s].size(); first += kLoraRows) {
      LoraBlock blk{s, static_cast<int64_t>(std::min<size_t>(kLoraRows, rows[s].size() - first)), {}};
      for (int64_t r = 0; r < blk.rows; ++r) blk.row[r] = rows[s][first + r];
      blocks.push_back(blk);
    }
  return blocks;
}

// out += each block's rows through its slot: x [T, K], out [T, N], a [S * P * R, K], b [S, R, N] (checked by the
// caller), P = part_starts.size() - 1
inline void lora_add_raw(const float* xp, int64_t K, float* op, int64_t N, const float* ap, const float* bp, int64_t R,
                         const std::vector<int64_t>& part_starts, const std::vector<LoraBlock>& blocks) {
  const int64_t PR = (static_cast<int64_t>(part_starts.size()) - 1) * R;
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> h(kLoraRows * PR);
    for (int64_t i = b0; i < b1; ++i) {
      const LoraBlock& blk = blocks[i];
      lora_block<kLoraRows>(xp, K, op, N, blk, ap + blk.slot * PR * K, bp + blk.slot * R * N, PR, R, part_starts,
                            h.data());
    }
  });
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
  lora_add_raw(x.data_ptr<float>(), K, out.data_ptr<float>(), N, a.data_ptr<float>(), b.data_ptr<float>(), R,
               part_starts, lora_blocks(slots.data_ptr<int64_t>(), T, S));
}

}  // namespace
