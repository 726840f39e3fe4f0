// Causal attention for the prompt tokens of a prefill step on CPU, over the paged cache (any simd::KvType, converted
// to fp32 as it is copied out, an int8 row times its scale; the arithmetic fp32).
//
// The one-query-per-row kernel (attention_decode.h) loads every key and value once per query token. Here a tile
// of query tokens of one sequence and one KV head shares them, as two small matrix products per tile:
//   scores [R, L] = Q [R, D] @ K^T [D, L]     (R = tokens x the G query heads of the KV head)
//   out    [R, D] = softmax(scores) @ V [L, D]
// The keys and values visible to the tile are copied once per (sequence, KV head) and thread out of the cache, as
// K^T in panels of kPanel keys ([D, kPanel] each) and V [L, D], so both products go through panel_linear.h's register
// block (a panel of K^T, or a window of kPanel columns of V): per step two vector loads feed kPanelMaxRows
// broadcasts and twice as many FMAs (8 and 16 on AVX-512, 6 and 12 on AVX2).
// Causality: row r (token at position p) keeps keys 0..p; the rest of its scores are zeroed after the softmax,
// and a block of rows reads keys only up to its last row's position.
// Both products go key block by key block (kPrefillKeyBlock keys), every row block of the tile inside: a block of
// K^T or V is then read from L2 by all of them, not streamed from L3 by each (a 17k-token context: 16-50 s per
// 512-token chunk on the 0.5B, 92% of it here). The softmax stays exact, over each whole row, between the two.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention_decode.h"
#include "panel_linear.h"
#include "work_units.h"

namespace {

constexpr int64_t kPrefillTileTokens = 64;  // query tokens per work item
constexpr int kPrefillRowBlock = kPanelMaxRows;  // query rows per register block
// Keys per block of the two products: K^T's 1,024 keys and V [1024, D] are 256 KB each at D = 64, 512 KB at 128
constexpr int64_t kPrefillKeyBlock = 1024;

struct PrefillScratch {
  std::vector<float> kt, v, q, scores, out;
  int64_t seq = -1, head = -1, ld = 0, num_keys = 0;  // kt and v hold keys [0, num_keys) of this (seq, head)
};

// One tile: tokens [j0, j1) of sequence `seq`, whose query tokens start at flat row q_start, the first at
// position first_pos, total_len = first_pos + its query tokens; KV head h. q/out [T, Hq, D].
// A thread keeps the K^T and V it copied for one (sequence, KV head) while its tiles come: a later tile copies the keys
// past those, an earlier one none (keys past its own are then in the panels, never read).
template <class Cache>
inline void prefill_tile(const float* q, float* out, const Cache& c, const int64_t* block_table, int64_t seq,
                         int64_t q_start, int64_t first_pos, int64_t total_len, int64_t j0, int64_t j1, int64_t h,
                         int64_t Hq, float scale, PrefillScratch& s) {
  const int64_t D = c.head_dim, G = Hq / c.num_kv_heads, ts = c.token_stride(), bs = c.block_stride();
  const int64_t BS = c.block_size;
  const int64_t num_keys = first_pos + j1;              // keys the tile's last token sees
  const int64_t R = (j1 - j0) * G;                      // query rows: token-major, then head
  if (s.seq != seq || s.head != h) {
    s.seq = seq, s.head = h, s.num_keys = 0;
    s.ld = (total_len + kPanel - 1) / kPanel * kPanel;  // keys padded to whole panels
    s.kt.assign(D * s.ld, 0.f);
    s.v.resize(s.ld * D);
  }
  const int64_t ld = s.ld;
  // K^T and V [ld, D] for this KV head, contiguous: the keys not copied yet, a run of one cache block's tokens at a
  // time (V read in place, through the block table, ran 30% slower on AVX2). K^T in panels of kPanel keys, each
  // [D, kPanel] contiguous as panel_linear's weights: a row-major K^T [D, ld] put a panel's D loads ld floats apart
  // (at 1,024 or 4,608 keys a stride of 4 KB or 18 KB, all in one or two sets of L1). V in panels of dimensions
  // instead measured no faster.
  for (int64_t t0 = s.num_keys; t0 < num_keys;) {
    const int64_t n = std::min(BS - t0 % BS, num_keys - t0), offset = block_table[t0 / BS] * bs + (t0 % BS) * ts;
    constexpr simd::KvType K = Cache::kType;
    const auto* kb = c.k + offset + h * c.row;
    float key_scale[kPrefillKeyBlock];  // n <= block_size <= kPrefillKeyBlock (checked at the entry)
    for (int64_t i = 0; i < n; ++i) key_scale[i] = simd::kv_scale<K>(kb + i * ts, D);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = t0 + i;
      float* dst = s.kt.data() + t / kPanel * (D * kPanel) + t % kPanel;  // key t's column of its panel
      for (int64_t d = 0; d < D; ++d) dst[d * kPanel] = simd::kv_to_float<K>(kb[i * ts + d]) * key_scale[i];
    }
    const auto* vb = c.v + offset + h * c.row;
    for (int64_t i = 0; i < n; ++i) simd::kv_row_to_float<K>(vb + i * ts, D, s.v.data() + (t0 + i) * D);
    t0 += n;
  }
  s.num_keys = std::max(s.num_keys, num_keys);
  // scaled queries [R, D]
  s.q.resize(R * D);
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t g = 0; g < G; ++g) {
      const float* src = q + ((q_start + j) * Hq + h * G + g) * D;
      float* dst = s.q.data() + ((j - j0) * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
    }
  s.scores.resize(R * ld);
  s.out.resize(R * D);
  auto row_block = [&](int64_t r0, int& rows, int64_t& block_keys, float*& sc) {
    rows = static_cast<int>(std::min<int64_t>(kPrefillRowBlock, R - r0));
    block_keys = first_pos + j0 + (r0 + rows - 1) / G + 1;  // keys the block's last row sees
    sc = s.scores.data() + r0 * ld;
  };
  int rows;
  int64_t block_keys;
  float* sc;
  // scores [R, keys] = Q K^T, key block by key block: a block of K^T serves every row block from L2 (streaming all
  // of K^T per row block from L3 took 92% of a 512-token chunk's time at 17k keys)
  for (int64_t k0 = 0; k0 < num_keys; k0 += kPrefillKeyBlock)
    for (int64_t r0 = 0; r0 < R; r0 += kPrefillRowBlock) {
      row_block(r0, rows, block_keys, sc);
      for (int64_t p = k0; p < std::min(block_keys, k0 + kPrefillKeyBlock); p += kPanel)
        panel_block_n<kPrefillRowBlock, false>(rows, s.q.data() + r0 * D, D, s.kt.data() + p * D, kPanel, D,
                                               sc + p, ld, kPanel);  // K^T's panel of keys p .. p + kPanel - 1
    }
  for (int64_t r0 = 0; r0 < R; r0 += kPrefillRowBlock) {
    row_block(r0, rows, block_keys, sc);
    for (int r = 0; r < rows; ++r) {  // softmax over the row's own keys; zero the rest of the block's range
      float* row = sc + r * ld;
      const int64_t len = first_pos + j0 + (r0 + r) / G + 1;
      const float inv = 1.f / exp_sum(row, len, max_of(row, len));
      for (int64_t t = 0; t < len; ++t) row[t] *= inv;
      std::fill(row + len, row + block_keys, 0.f);
    }
  }
  // out [R, D] = P [R, keys] @ V [keys, D], key block by key block (the first block writes, later ones add: up to
  // kPrefillKeyBlock keys this is one product, as before)
  float part[kPrefillRowBlock * kPanel];
  for (int64_t k0 = 0; k0 < num_keys; k0 += kPrefillKeyBlock)
    for (int64_t r0 = 0; r0 < R; r0 += kPrefillRowBlock) {
      row_block(r0, rows, block_keys, sc);
      const int64_t depth = std::min(block_keys, k0 + kPrefillKeyBlock) - k0;
      if (depth <= 0) continue;
      for (int64_t d0 = 0; d0 < D; d0 += kPanel) {
        float* o = s.out.data() + r0 * D + d0;
        if (k0 == 0) {
          panel_block_n<kPrefillRowBlock, false>(rows, sc, ld, s.v.data() + d0, D, depth, o, D, kPanel);
          continue;
        }
        panel_block_n<kPrefillRowBlock, false>(rows, sc + k0, ld, s.v.data() + k0 * D + d0, D, depth, part, kPanel,
                                               kPanel);
        for (int r = 0; r < rows; ++r)
          for (int c = 0; c < kPanel; ++c) o[r * D + c] += part[r * kPanel + c];
      }
    }
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t g = 0; g < G; ++g)
      std::copy_n(s.out.data() + ((j - j0) * G + g) * D, D, out + ((q_start + j) * Hq + h * G + g) * D);
}

}  // namespace

inline bool paged_prefill_supported(int64_t head_dim) { return head_dim > 0 && head_dim % kPanel == 0; }

// out/q [T, Hq, D]; caches [num_blocks, block_size, Hkv, row] (row: D, or D + 4 for int8); block_tables [num_tables, max_blocks] int64;
// seqs [n, 4] int64: (first flat row, number of query tokens, position of the first one, block table row).
// Writes the rows of those sequences into out; other rows are left as they are.
inline void paged_prefill_(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seqs, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32, "q and out: fp32");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "contiguous only");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q/out [T, Hq, D], caches [num_blocks, block_size, Hkv, D]");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2), BS = k_cache.size(1);
  TORCH_CHECK(Hq % Hkv == 0 && kv_head_dim(k_cache) == D && paged_prefill_supported(D) &&
                  BS <= kPrefillKeyBlock, "head shapes, block_size");
  auto bt = block_tables.contiguous();
  auto sq = seqs.contiguous();
  TORCH_CHECK(bt.dtype() == torch::kInt64 && bt.dim() == 2 && sq.dtype() == torch::kInt64 && sq.dim() == 2 &&
                  sq.size(1) == 4,
              "block_tables [num_tables, max_blocks], seqs [n, 4], int64");
  const int64_t* tp = bt.data_ptr<int64_t>();
  const int64_t* sp = sq.data_ptr<int64_t>();
  const int64_t n = sq.size(0), max_blocks = bt.size(1), num_blocks = k_cache.size(0);
  for (int64_t i = 0; i < bt.numel(); ++i) TORCH_CHECK(tp[i] >= 0 && tp[i] < num_blocks, "block id out of range");
  // Work items: (sequence, KV head, tile of up to kPrefillTileTokens tokens), the costliest first (query tokens x keys
  // seen: a causal tile's grows with its position), taken by the threads as they come free (work_units.h); a
  // sequence's heads alternate, so that each thread tends to stay on one and reuse its K^T and V.
  struct Item {
    int64_t seq, head, j0;
    double cost;
  };
  std::vector<Item> items;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t start = sp[i * 4], len = sp[i * 4 + 1], first_pos = sp[i * 4 + 2], table = sp[i * 4 + 3];
    TORCH_CHECK(start >= 0 && len > 0 && start + len <= T && first_pos >= 0 && table >= 0 && table < bt.size(0) &&
                    first_pos + len <= max_blocks * BS,
                "seqs row out of range");
    for (int64_t j0 = 0; j0 < len; j0 += kPrefillTileTokens)
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t j1 = std::min(len, j0 + kPrefillTileTokens);
        items.push_back({i, h, j0, double(j1 - j0) * double(first_pos + j1 + kPanel)});
      }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  with_paged_cache(k_cache, v_cache, [&](const auto& cache) {
    parallel_units_with<PrefillScratch>(static_cast<int64_t>(items.size()), [&](PrefillScratch& scratch, int64_t u) {
      const Item& it = items[u];
      const int64_t i = it.seq, len = sp[i * 4 + 1], first_pos = sp[i * 4 + 2];
      prefill_tile(qp, op, cache, tp + sp[i * 4 + 3] * max_blocks, i, sp[i * 4], first_pos, first_pos + len, it.j0,
                   std::min(len, it.j0 + kPrefillTileTokens), it.head, Hq, static_cast<float>(scale), scratch);
    });
  });
}
