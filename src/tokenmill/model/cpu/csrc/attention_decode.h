// Paged attention for decode rows on CPU: each row's single query attends over its own blocks, read in place from
// the paged cache. No gather, no padding. Cache layout per layer: [num_blocks, block_size, Hkv, row], its elements
// fp32, fp16, bf16 or fp8 e4m3 (row = D), or int8 codes with their fp32 scale after them (row = D + 4 bytes)
// (simd::KvType: converted to fp32 as they are loaded, the arithmetic fp32 throughout; an int8 key's scale
// multiplies its score, a value's scale its softmax weight); query heads h*G .. h*G+G-1 share KV head h.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  using namespace simd;
  Vec acc = zero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = fmadd(load(a + i), load(b + i), acc);
  if (i < n) {
    const int m = static_cast<int>(n - i);
    acc = fmadd(load_n(a + i, m), load_n(b + i, m), acc);
  }
  return reduce_add(acc);
}

// out[i] += w * v[i]
inline void axpy(float w, const float* v, float* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] += w * v[i];
}

template <simd::KvType K = simd::KvType::kF32>
struct PagedCache {
  using Elem = simd::KvElem<K>;
  static constexpr simd::KvType kType = K;
  const Elem* k;
  const Elem* v;
  int64_t block_size, num_kv_heads, head_dim;
  int64_t row = head_dim + simd::kKvRowExtra<K>;  // elements from one (token, KV head) row to the next
  int64_t token_stride() const { return num_kv_heads * row; }
  int64_t block_stride() const { return block_size * num_kv_heads * row; }
  // One token's keys and values [num_kv_heads * head_dim] fp32 into cache slot `slot`, in the cache's element
  // type (rounded as torch's .to() rounds; int8 as kv_format.py encodes). The cache tensors are the caller's,
  // writable: the pointers are const for the readers.
  void write_token(int64_t slot, const float* keys, const float* values) const {
    simd::kv_token_from_float<K>(keys, num_kv_heads, head_dim, const_cast<Elem*>(k) + slot * token_stride());
    simd::kv_token_from_float<K>(values, num_kv_heads, head_dim, const_cast<Elem*>(v) + slot * token_stride());
  }
};


// scores[0, n) = exp(scores - max_score); returns their sum. The tail goes through the vector exp too (masked):
// a scalar std::exp per leftover element cost ~20 ns each, per row and head.
inline float exp_sum(float* scores, int64_t n, float max_score) {
  using namespace simd;
  Vec acc = zero();
  const Vec m = set1(max_score);
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    const Vec e = simd::exp(sub(load(scores + t), m));
    store(scores + t, e);
    acc = add(acc, e);
  }
  if (t < n) {
    const int k = static_cast<int>(n - t);
    const Vec e = keep_first(simd::exp(sub(load_n(scores + t, k), m)), k);
    store_n(scores + t, e, k);
    acc = add(acc, e);
  }
  return reduce_add(acc);
}

// max of scores[0, n), n >= 1
inline float max_of(const float* scores, int64_t n) {
  using namespace simd;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  Vec m = set1(neg_inf), m1 = m, m2 = m, m3 = m;  // four chains: one waits on each max's latency
  int64_t t = 0;
  for (; t + 4 * kLanes <= n; t += 4 * kLanes) {
    m = max(m, load(scores + t)), m1 = max(m1, load(scores + t + kLanes));
    m2 = max(m2, load(scores + t + 2 * kLanes)), m3 = max(m3, load(scores + t + 3 * kLanes));
  }
  for (; t + kLanes <= n; t += kLanes) m = max(m, load(scores + t));
  if (t < n) m = max(m, load_n(scores + t, static_cast<int>(n - t), neg_inf));
  return reduce_max(max(max(m, m1), max(m2, m3)));
}

// Blocks sit anywhere in the pool, so no hardware prefetcher can guess the next one. Each thread walks its own
// items (row, KV head) in order; this cursor runs kPrefetchBlocks blocks ahead of the keys being read, across item
// and row boundaries, and asks for that block's keys and values (one KV head's, up to block_size tokens) into L2.
// Measured (64 rows x 220 tokens x 30 layers, 649 MB of K/V, 2 threads): 30-31 ms against 36-38 ms for the
// previous scheme (head 0's pass prefetching the whole row's blocks 3 ahead, nothing across rows); 2 or 6-16
// blocks ahead, the whole block for all heads at once, or token-major passes over all heads of a row were no
// better, prefetching into L1 worse.
constexpr int kPrefetchBlocks = 4;
template <class Cache>
struct Prefetcher {
  const Cache& c;
  const int64_t* block_tables;
  int64_t max_blocks;
  const int64_t* seq_lens;
  const int64_t* table_index;
  int64_t items_per_row, chunks_per_kv;
  int64_t item, end, block = 0;

  void step() {
    const int64_t BS = c.block_size, D = c.head_dim, ts = c.token_stride();
    while (item < end) {
      const int64_t b = item / items_per_row, h = (item % items_per_row) / chunks_per_kv;
      const int64_t len = seq_lens[b];
      if (block * BS < len) {
        const int64_t table = table_index != nullptr ? table_index[b] : b;
        const int64_t off = block_tables[table * max_blocks + block] * c.block_stride() + h * c.row;
        const int64_t n = std::min(BS, len - block * BS);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t d = 0; d < D; d += 64 / int64_t(sizeof(typename Cache::Elem))) {  // a 64-byte line each
            simd::prefetch_l2(c.k + off + i * ts + d);
            simd::prefetch_l2(c.v + off + i * ts + d);
          }
        ++block;
        return;
      }
      ++item;
      block = 0;
    }
  }
};

constexpr int64_t kMaxGroup = 16;  // query heads per KV head handled together (larger groups are split)

// A key or value row as fp32: the cache's own row when it is fp32, else converted into `scratch` [n].
template <simd::KvType K>
inline const float* as_float_row(const simd::KvElem<K>* p, int64_t n, float* scratch) {
  if constexpr (K == simd::KvType::kF32) {
    return p;
  } else {
    simd::kv_row_to_float<K>(p, n, scratch);
    return scratch;
  }
}

// The head size of a KV cache [num_blocks, block_size, Hkv, row]: row, less int8's trailing scale.
inline int64_t kv_head_dim(const torch::Tensor& cache) {
  return cache.size(3) - (cache.scalar_type() == torch::kChar ? simd::kKvRowExtra<simd::KvType::kI8> : 0);
}

// Calls fn(cache) with the paged cache of k_cache and v_cache in their element type.
template <class Fn>
inline void with_paged_cache(const torch::Tensor& k_cache, const torch::Tensor& v_cache, Fn&& fn) {
  using simd::KvType;
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2), D = kv_head_dim(k_cache);
  TORCH_CHECK(D > 0, "KV caches: an int8 row is D codes and a 4-byte scale");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "K and V caches of one dtype");
  switch (k_cache.scalar_type()) {
    case torch::kFloat32:
      fn(PagedCache<KvType::kF32>{k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), BS, Hkv, D});
      break;
    case torch::kFloat16:
      fn(PagedCache<KvType::kF16>{reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::Half>()),
                                  reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::Half>()), BS, Hkv, D});
      break;
    case torch::kBFloat16:
      fn(PagedCache<KvType::kBF16>{reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
                                   reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()), BS, Hkv, D});
      break;
    case torch::kFloat8_e4m3fn:
      fn(PagedCache<KvType::kF8E4M3>{reinterpret_cast<const uint8_t*>(k_cache.data_ptr<at::Float8_e4m3fn>()),
                                     reinterpret_cast<const uint8_t*>(v_cache.data_ptr<at::Float8_e4m3fn>()), BS, Hkv,
                                     D});
      break;
    case torch::kChar:
      fn(PagedCache<KvType::kI8>{k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(), BS, Hkv, D});
      break;
    default:
      TORCH_CHECK(false, "KV caches: fp32, fp16, bf16, fp8 e4m3 or int8, not ", k_cache.scalar_type());
  }
}

// attend_group for head_dim = kLanes * NV and GC query heads, the queries and outputs held in vectors (in registers
// where they fit, else spilled to L1 and read as FMA operands): QK four tokens at a time (one batched reduction per
// head), the softmax with a vector exp, PV accumulated in GC * NV vectors.
template <int NV, int GC, class Cache>
inline void attend_group_fixed(const float* q, const Cache& c, const int64_t* block_table, int64_t seq_len,
                               int64_t kv_head, float scale, float* out, float* scores, Prefetcher<Cache>& pf) {
  constexpr simd::KvType K = Cache::kType;
  using namespace simd;
  constexpr int64_t D = kLanes * NV;
  const int64_t ts = c.token_stride(), bs = c.block_stride(), BS = c.block_size;
  Vec qv[GC][NV];
  for (int g = 0; g < GC; ++g)
    for (int v = 0; v < NV; ++v) qv[g][v] = mul(load(q + g * D + kLanes * v), set1(scale));
  for (int64_t t0 = 0; t0 < seq_len; t0 += BS) {
    const auto* kb = c.k + block_table[t0 / BS] * bs + kv_head * c.row;
    const int64_t n = std::min(BS, seq_len - t0);
    pf.step();
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
      Vec acc[GC][4];
      for (int g = 0; g < GC; ++g)
        for (int j = 0; j < 4; ++j) acc[g][j] = zero();
      for (int v = 0; v < NV; ++v)
        for (int j = 0; j < 4; ++j) {
          const Vec kv = load_kv<K>(kb + (i + j) * ts + kLanes * v);
          for (int g = 0; g < GC; ++g) acc[g][j] = fmadd(qv[g][v], kv, acc[g][j]);
        }
      for (int g = 0; g < GC; ++g) reduce_add4(acc[g][0], acc[g][1], acc[g][2], acc[g][3], scores + g * seq_len + t0 + i);
    }
    for (; i < n; ++i)
      for (int g = 0; g < GC; ++g) {
        Vec acc = zero();
        for (int v = 0; v < NV; ++v) acc = fmadd(qv[g][v], load_kv<K>(kb + i * ts + kLanes * v), acc);
        scores[g * seq_len + t0 + i] = reduce_add(acc);
      }
    if constexpr (K == simd::KvType::kI8)  // each key's codes times its scale
      for (int64_t j = 0; j < n; ++j) {
        const float ks = kv_scale<K>(kb + j * ts, D);
        for (int g = 0; g < GC; ++g) scores[g * seq_len + t0 + j] *= ks;
      }
  }
  float inv[GC];
  for (int g = 0; g < GC; ++g) {
    float* sg = scores + g * seq_len;
    const float max_score = max_of(sg, seq_len);
    inv[g] = 1.f / exp_sum(sg, seq_len, max_score);
  }
  Vec o[GC][NV];
  for (int g = 0; g < GC; ++g)
    for (int v = 0; v < NV; ++v) o[g][v] = zero();
  for (int64_t t0 = 0; t0 < seq_len; t0 += BS) {
    const auto* vb = c.v + block_table[t0 / BS] * bs + kv_head * c.row;
    const int64_t n = std::min(BS, seq_len - t0);
    for (int64_t i = 0; i < n; ++i) {
      Vec vv[NV];
      for (int v = 0; v < NV; ++v) vv[v] = load_kv<K>(vb + i * ts + kLanes * v);
      for (int g = 0; g < GC; ++g) {
        const Vec p = set1(scores[g * seq_len + t0 + i] * kv_scale<K>(vb + i * ts, D));
        for (int v = 0; v < NV; ++v) o[g][v] = fmadd(p, vv[v], o[g][v]);
      }
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int v = 0; v < NV; ++v) store(out + g * D + kLanes * v, mul(o[g][v], set1(inv[g])));
}

// attend_group_fixed for up to GC query heads at a time (a run-time count 1 <= g <= GC)
template <int NV, int GC, class Cache>
inline void attend_group_chunk(int g, const float* q, const Cache& c, const int64_t* block_table,
                               int64_t seq_len, int64_t kv_head, float scale, float* out, float* scores,
                               Prefetcher<Cache>& pf) {
  if constexpr (GC >= 1) {
    if (g == GC) return attend_group_fixed<NV, GC>(q, c, block_table, seq_len, kv_head, scale, out, scores, pf);
    attend_group_chunk<NV, GC - 1>(g, q, c, block_table, seq_len, kv_head, scale, out, scores, pf);
  }
}

// Query heads per register kernel call. Four for both head sizes and both instruction sets, measured (64 rows x
// 220 tokens x 30 layers, 2 threads, on AVX-512 hardware): AVX2 at D = 64, 9 query / 3 KV heads, 31 ms with one
// head a call (its query in registers), 20 ms with all three (the queries spill to L1 and feed the FMAs as memory
// operands); at D = 128, 8 / 2 heads, 32 rows: AVX2 25 ms with one head, 17 with four; AVX-512 21 ms with two
// (the queries in registers), 13.5 with four.
constexpr int kGroupChunk = 4;

// The G (<= kMaxGroup) query heads that share KV head `kv_head`, for one decode row: q [G, D] over the row's first
// `seq_len` cached tokens -> out [G, D]. `scores` is scratch of at least G * seq_len floats. Each K and V row is
// loaded once for all G heads.
template <class Cache>
inline void attend_group(const float* q, int64_t G, const Cache& c, const int64_t* block_table,
                         int64_t seq_len, int64_t kv_head, float scale, float* out, float* scores,
                         Prefetcher<Cache>& pf) {
  constexpr simd::KvType K = Cache::kType;
  const int64_t D = c.head_dim;
  // Register kernels for the common head sizes, in chunks of query heads (not on base: its vectors are arrays)
  if (simd::kNumRegs >= 16 && (D == 64 || D == 128)) {
    for (int64_t g0 = 0; g0 < G; g0 += kGroupChunk) {
      const int g = static_cast<int>(std::min<int64_t>(kGroupChunk, G - g0));
      if (D == 64)
        attend_group_chunk<64 / simd::kLanes, kGroupChunk>(g, q + g0 * D, c, block_table, seq_len, kv_head, scale,
                                                           out + g0 * D, scores, pf);
      else
        attend_group_chunk<128 / simd::kLanes, kGroupChunk>(g, q + g0 * D, c, block_table, seq_len, kv_head, scale,
                                                            out + g0 * D, scores, pf);
    }
    return;
  }
  const int64_t ts = c.token_stride(), bs = c.block_stride(), BS = c.block_size;
  std::vector<float> row(K == simd::KvType::kF32 ? 0 : D);  // a key or value row of another dtype as fp32

  float max_score[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) max_score[g] = -std::numeric_limits<float>::infinity();
  for (int64_t t0 = 0; t0 < seq_len; t0 += BS) {
    const auto* kb = c.k + block_table[t0 / BS] * bs + kv_head * c.row;
    const int64_t n = std::min(BS, seq_len - t0);
    pf.step();
    for (int64_t i = 0; i < n; ++i) {
      const float* k = as_float_row<K>(kb + i * ts, D, row.data());
      for (int64_t g = 0; g < G; ++g) {
        const float s = dot(q + g * D, k, D) * scale;
        scores[g * seq_len + t0 + i] = s;
        max_score[g] = std::max(max_score[g], s);
      }
    }
  }
  float inv[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) inv[g] = 1.f / exp_sum(scores + g * seq_len, seq_len, max_score[g]);
  std::fill(out, out + G * D, 0.f);
  for (int64_t t0 = 0; t0 < seq_len; t0 += BS) {
    const auto* vb = c.v + block_table[t0 / BS] * bs + kv_head * c.row;
    const int64_t n = std::min(BS, seq_len - t0);
    for (int64_t i = 0; i < n; ++i) {
      const float* v = as_float_row<K>(vb + i * ts, D, row.data());
      for (int64_t g = 0; g < G; ++g) axpy(scores[g * seq_len + t0 + i] * inv[g], v, out + g * D, D);
    }
  }
}

// Rows x KV-head groups as one parallel range: q [B, Hq, D] -> out [B, Hq, D].
// Row b reads block table table_index[b] (b itself when table_index is null).
template <class Cache>
inline void attend_rows(const float* q, const Cache& c, const int64_t* block_tables, int64_t max_blocks,
                        const int64_t* seq_lens, int64_t B, int64_t Hq, float scale, float* out,
                        const int64_t* table_index = nullptr) {
  const int64_t D = c.head_dim, G = Hq / c.num_kv_heads;
  const int64_t chunk = std::min(G, kMaxGroup), chunks_per_kv = (G + chunk - 1) / chunk;
  const int64_t items_per_row = c.num_kv_heads * chunks_per_kv;
  at::parallel_for(0, B * items_per_row, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    Prefetcher<Cache> pf{c, block_tables, max_blocks, seq_lens, table_index, items_per_row, chunks_per_kv, begin, end};
    for (int p = 0; p < kPrefetchBlocks; ++p) pf.step();
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / items_per_row, h = (item % items_per_row) / chunks_per_kv;
      const int64_t g0 = (item % chunks_per_kv) * chunk, g = std::min(chunk, G - g0);
      const int64_t head0 = h * G + g0;  // first query head of this chunk
      scores.resize(g * seq_lens[b]);
      const int64_t table = table_index != nullptr ? table_index[b] : b;
      attend_group(q + (b * Hq + head0) * D, g, c, block_tables + table * max_blocks, seq_lens[b], h, scale,
                   out + (b * Hq + head0) * D, scores.data(), pf);
    }
  });
}

}  // namespace

// q [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, row] (row: D, or D + 4 for int8); block_tables [num_tables, max_blocks] int64;
// seq_lens [B] int64; table_index [B] int64 (optional: which table row b reads; default b) -> out [B, Hq, D].
// A prefill token is a row too: its query over its own causal prefix (seq_len = position + 1).
inline torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                  torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                  c10::optional<torch::Tensor> table_index) {
  TORCH_CHECK(q.dtype() == torch::kFloat32, "q: fp32");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous only");
  TORCH_CHECK(block_tables.dtype() == torch::kInt64 && seq_lens.dtype() == torch::kInt64, "int64 indices");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  TORCH_CHECK(Hq % k_cache.size(2) == 0 && kv_head_dim(k_cache) == D && v_cache.sizes() == k_cache.sizes(), "head shapes");
  auto bt = block_tables.contiguous();
  auto sl = seq_lens.contiguous();
  TORCH_CHECK(bt.dim() == 2 && sl.numel() == B, "block_tables [num_tables, max_blocks], seq_lens [B]");
  torch::Tensor ti;
  if (table_index.has_value()) {
    ti = table_index->contiguous();
    TORCH_CHECK(ti.dtype() == torch::kInt64 && ti.numel() == B, "table_index: int64 [B]");
  } else {
    TORCH_CHECK(bt.size(0) == B, "one block table per row");
  }
  // Bounds: every row's tokens lie in its table, every table entry in the pool (no read outside the caches).
  const int64_t BS = k_cache.size(1), max_blocks = bt.size(1), num_blocks = k_cache.size(0);
  const int64_t* tp = bt.data_ptr<int64_t>();
  for (int64_t i = 0; i < bt.numel(); ++i) TORCH_CHECK(tp[i] >= 0 && tp[i] < num_blocks, "block id out of range");
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = sl.data_ptr<int64_t>()[b];
    TORCH_CHECK(len > 0 && len <= max_blocks * BS, "seq_len out of range");
    if (ti.defined()) TORCH_CHECK(ti.data_ptr<int64_t>()[b] >= 0 && ti.data_ptr<int64_t>()[b] < bt.size(0), "table_index");
  }
  auto out = torch::empty_like(q);
  with_paged_cache(k_cache, v_cache, [&](const auto& cache) {
    attend_rows(q.data_ptr<float>(), cache, tp, max_blocks, sl.data_ptr<int64_t>(), B, Hq, static_cast<float>(scale),
                out.data_ptr<float>(), ti.defined() ? ti.data_ptr<int64_t>() : nullptr);
  });
  return out;
}
