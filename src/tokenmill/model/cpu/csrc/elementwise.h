// The eager forward's elementwise work, one pass each instead of a chain of torch ops (CPU, fp32, contiguous):
// RMSNorm (optionally adding a residual first), SiLU(gate) * up, and RoPE on q/k with the new K/V written into
// the paged cache. Each replaces 4-10 torch ops and as many passes over [num_tokens, width] tensors.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "attention_decode.h"
#include "simd.h"

namespace {

inline void check_fp32_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == torch::kFloat32 && t.is_contiguous() && !t.is_cuda(), name,
              " must be a contiguous float32 CPU matrix");
}

inline void rms_norm_row(const float* x, const float* w, int64_t H, float eps, float* y) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i) y[i] = w[i] * (x[i] * r);
}

// Rotate pairs (i, i + R/2) of the first R dims of `heads` heads (cos/sin: R/2 angles), the other D - R dims
// passing through: in [heads, D] -> out [heads, D] (may be the same memory). R = D but for partial rotary (Phi).
inline void rope_heads(const float* in, float* out, int64_t heads, int64_t D, int64_t R, const float* cos,
                       const float* sin) {
  const int64_t half = R / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const float* x = in + h * D;
    float* o = out + h * D;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      o[i] = a * cos[i] - b * sin[i];
      o[i + half] = b * cos[i] + a * sin[i];
    }
    if (o != x) std::copy(x + R, x + D, o + R);
  }
}

// RMSNorm over each of `heads` heads of D values, in place (Qwen3's q/k norm): x [heads, D].
inline void rms_norm_heads_(float* x, int64_t heads, int64_t D, const float* w, float eps) {
  for (int64_t h = 0; h < heads; ++h) rms_norm_row(x + h * D, w, D, eps, x + h * D);
}

inline void silu_mul_row(const float* gate, const float* up, int64_t n, float* out) {
  using namespace simd;
  const Vec one = set1(1.f);
  // std::exp does not vectorize without -ffast-math (3x slower); e^-g under -87 clamps: e^-g -> 0, silu -> g
  auto silu_times = [&](Vec g, Vec u) { return mul(div(g, add(one, simd::exp(sub(zero(), g)))), u); };
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store(out + i, silu_times(load(gate + i), load(up + i)));
  if (i < n) {
    const int m = static_cast<int>(n - i);
    store_n(out + i, silu_times(load_n(gate + i, m), load_n(up + i, m)), m);
  }
}

}  // namespace

// x [T, H] -> x * rsqrt(mean(x^2) + eps) * weight.
inline torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_fp32_rows(x, "x");
  TORCH_CHECK(weight.numel() == x.size(1) && weight.is_contiguous(), "weight must be [hidden]");
  auto y = torch::empty_like(x);
  const int64_t H = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) rms_norm_row(xp + t * H, wp, H, static_cast<float>(eps), yp + t * H);
  });
  return y;
}

// residual += delta (in place), then returns rms_norm(residual).
inline torch::Tensor add_rms_norm_(torch::Tensor residual, torch::Tensor delta, torch::Tensor weight, double eps) {
  check_fp32_rows(residual, "residual");
  check_fp32_rows(delta, "delta");
  TORCH_CHECK(residual.sizes() == delta.sizes(), "residual and delta shapes differ");
  TORCH_CHECK(weight.numel() == residual.size(1) && weight.is_contiguous(), "weight must be [hidden]");
  auto y = torch::empty_like(residual);
  const int64_t H = residual.size(1);
  float* rp = residual.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, residual.size(0), 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* r = rp + t * H;
      const float* d = dp + t * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) r[i] += d[i];
      rms_norm_row(r, wp, H, static_cast<float>(eps), yp + t * H);
    }
  });
  return y;
}

// gate_up [T, 2I] (gate | up) -> silu(gate) * up [T, I].
inline torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_fp32_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto y = torch::empty({T, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) silu_mul_row(gp + t * 2 * I, gp + t * 2 * I + I, I, yp + t * I);
  });
  return y;
}

// qkv [T, (Hq + 2 Hkv) D] (q | k | v per row) -> RMSNorm of every q head (weight q_norm [D]) and k head (k_norm),
// in place: Qwen3's norm before RoPE.
inline void qk_norm_(torch::Tensor qkv, torch::Tensor q_norm, torch::Tensor k_norm, int64_t num_heads,
                     int64_t num_kv_heads, double eps) {
  check_fp32_rows(qkv, "qkv");
  const int64_t D = q_norm.numel(), T = qkv.size(0);
  TORCH_CHECK(q_norm.is_contiguous() && k_norm.is_contiguous() && k_norm.numel() == D &&
                  q_norm.scalar_type() == torch::kFloat32 && k_norm.scalar_type() == torch::kFloat32,
              "q_norm / k_norm: float32 [head_dim]");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * D, "qkv width does not match the heads");
  float* p = qkv.data_ptr<float>();
  const float* qw = q_norm.data_ptr<float>();
  const float* kw = k_norm.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* row = p + t * qkv.size(1);
      rms_norm_heads_(row, num_heads, D, qw, static_cast<float>(eps));
      rms_norm_heads_(row + num_heads * D, num_kv_heads, D, kw, static_cast<float>(eps));
    }
  });
}

// qkv [T, (Hq + 2 Hkv) D] (q | k | v per row), cos/sin [T, R/2]: rotates q and k (pairs i, i + R/2 of the first R
// dims), writes k and v to the caches [num_blocks, block_size, Hkv, row] at slot_mapping [T] in the caches' dtype
// (simd::kv_token_from_float: the decode stack's rotation and rounding, so a token's K and V have the same bits
// whichever path computed it), returns the rotated q [T, Hq, D].
inline torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                                   torch::Tensor v_cache, torch::Tensor slot_mapping, int64_t num_heads,
                                   int64_t num_kv_heads) {
  check_fp32_rows(qkv, "qkv");
  check_fp32_rows(cos, "cos");
  check_fp32_rows(sin, "sin");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  k_cache.sizes() == v_cache.sizes(),
              "caches must be contiguous [num_blocks, block_size, Hkv, row]");
  const int64_t T = qkv.size(0), D = kv_head_dim(k_cache), half = cos.size(1), R = 2 * half, Hq = num_heads,
                Hkv = num_kv_heads;
  TORCH_CHECK(k_cache.size(2) == Hkv && qkv.size(1) == (Hq + 2 * Hkv) * D, "qkv width does not match the heads");
  TORCH_CHECK(cos.size(0) == T && 0 < R && R <= D && sin.sizes() == cos.sizes(),
              "cos/sin must be [T, R/2] for R <= D rotated dims");
  TORCH_CHECK(slot_mapping.numel() == T && slot_mapping.scalar_type() == torch::kInt64, "slot_mapping: int64 [T]");
  auto slots_t = slot_mapping.contiguous();
  const int64_t* slots = slots_t.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), kv_size = Hkv * D, q_size = Hq * D;
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
  auto q = torch::empty({T, Hq, D}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  with_paged_cache(k_cache, v_cache, [&](const auto& cache) {
    at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
      std::vector<float> k_rot(kv_size);
      for (int64_t t = b; t < e; ++t) {
        const float* row = src + t * (q_size + 2 * kv_size);
        rope_heads(row, qp + t * q_size, Hq, D, R, cp + t * half, sp + t * half);
        rope_heads(row + q_size, k_rot.data(), Hkv, D, R, cp + t * half, sp + t * half);
        cache.write_token(slots[t], k_rot.data(), row + q_size + kv_size);
      }
    });
  });
  return q;
}
