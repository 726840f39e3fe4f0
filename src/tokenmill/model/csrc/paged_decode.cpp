// Paged attention for decode rows on CPU (fp32): each row's single query attends over its own blocks,
// read in place from the paged cache. No gather, no padding: K and V are read once per (row, KV head).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// q [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks] int64;
// seq_lens [B] int64 -> out [B, Hq, D]. Query heads h*G .. h*G+G-1 share KV head h.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32, "fp32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous only");
  TORCH_CHECK(block_tables.dtype() == torch::kInt64 && seq_lens.dtype() == torch::kInt64, "int64 indices");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(Hq % Hkv == 0 && k_cache.size(3) == D, "head shapes");
  const int64_t G = Hq / Hkv, MB = block_tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* bt = block_tables.contiguous().data_ptr<int64_t>();
  const int64_t* sl = seq_lens.contiguous().data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t block_stride = BS * Hkv * D, token_stride = Hkv * D;
  const float fscale = static_cast<float>(scale);

  // One task per row: its blocks are read front to back, all KV heads of a token at once (one contiguous
  // Hkv * D run), which streams far better than visiting each head's strided slice separately.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, row_max(Hq), row_inv(Hq);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = sl[b];
      scores.resize(Hq * L);
      const float* qb = qp + b * Hq * D;
      std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<float>::infinity());
      for (int64_t t = 0; t < L; ++t) {
        const float* kt = kp + bt[b * MB + t / BS] * block_stride + (t % BS) * token_stride;
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const float* qh = qb + hq * D;
          const float* kr = kt + (hq / G) * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qh[d] * kr[d];
          s *= fscale;
          scores[hq * L + t] = s;
          row_max[hq] = std::max(row_max[hq], s);
        }
      }
      for (int64_t hq = 0; hq < Hq; ++hq) {
        float sum = 0.f;
        float* sh = scores.data() + hq * L;
        const float m = row_max[hq];
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < L; ++t) {
          sh[t] = std::exp(sh[t] - m);
          sum += sh[t];
        }
        row_inv[hq] = 1.f / sum;
      }
      float* ob = op + b * Hq * D;
      std::fill(ob, ob + Hq * D, 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const float* vt = vp + bt[b * MB + t / BS] * block_stride + (t % BS) * token_stride;
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const float w = scores[hq * L + t] * row_inv[hq];
          const float* vr = vt + (hq / G) * D;
          float* oh = ob + hq * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) oh[d] += w * vr[d];
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU, fp32)");
}
