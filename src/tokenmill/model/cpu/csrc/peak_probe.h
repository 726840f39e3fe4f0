// The arithmetic peaks of this CPU, as the kernels reach them: loops that keep their operands in registers and
// issue one instruction on kAccs independent accumulators, so neither memory nor one chain's latency bounds them.
// qdot_peak: simd::qdot32, the 8-bit-activation kernels' integer dot product (vpdpbusd on AVX-512 VNNI;
// vpmaddubsw + vpmaddwd + vpaddd on AVX2); dot_fma_mix, the same with multiply-adds beside it. fma_peak:
// simd::fmadd, the fp32 kernels' multiply-add (torch's own matmuls can fall well short of it: on Zen 5 they reach
// about half). Every torch thread runs the loop (model/hardware.py times the call and divides the operations by the
// time).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

#include "simd.h"

namespace tokenmill_peak {

inline constexpr int kAccs = 12;  // independent chains: more than latency x throughput of the instruction

// `iters` rounds of kDots qdot32 calls and kFmas fmadd calls, each on accumulators of its own, on each of
// `num_threads` workers; returns a checksum of the sums (so the loop cannot be dropped). Each qdot32 call is
// sizeof(QVec) multiply-adds, two integer operations each; each fmadd adds 0 times 1 to its accumulator's index, the
// multiplier and addend read through volatiles so the compiler cannot fold the loop away, and the sums stay exact.
template <int kDots, int kFmas>
inline int64_t dot_loop(int64_t iters, int64_t num_threads) {
  static_assert(kDots >= 0 && kFmas >= 0 && kDots + kFmas > 0, "dot products, multiply-adds, or both");
  TORCH_CHECK(iters > 0 && num_threads > 0, "peak probe: iters and num_threads must be positive");
  std::atomic<int64_t> checksum{0};
  at::parallel_for(0, num_threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      uint8_t cbytes[sizeof(simd::QVec)];
      uint8_t xbytes[sizeof(simd::QVec)];
      for (size_t i = 0; i < sizeof(simd::QVec); ++i) {  // each quad's products cancel: sums stay 0, no overflow
        cbytes[i] = static_cast<uint8_t>(((i / 2) * 7 + t) & 63);
        xbytes[i] = static_cast<uint8_t>(i % 2 == 0 ? 1 : 0xFF);  // +1, -1
      }
      const simd::QVec codes = simd::byte_quad(cbytes), x = simd::byte_quad(xbytes);
      // distinct starting sums: kDots chains the compiler cannot merge into one
      simd::QAcc32 acc[kDots > 0 ? kDots : 1];
      for (int a = 0; a < kDots; ++a) {
        int32_t start[sizeof(simd::QAcc32) / 4];
        for (auto& v : start) v = a;
        std::memcpy(&acc[a], start, sizeof(start));
      }
      volatile float one = 1.0f, zero = 0.0f;
      const simd::Vec b = simd::set1(one), c = simd::set1(zero);
      simd::Vec facc[kFmas > 0 ? kFmas : 1];
      for (int a = 0; a < kFmas; ++a) facc[a] = simd::set1(static_cast<float>(a));
      for (int64_t i = 0; i < iters; ++i) {
        for (int a = 0; a < kDots; ++a) acc[a] = simd::qdot32(acc[a], codes, x);
        for (int a = 0; a < kFmas; ++a) facc[a] = simd::fmadd(facc[a], b, c);
      }
      float out[simd::kLanes];
      int64_t sum = 0;
      for (int a = 0; a < kDots; ++a) {
        simd::store(out, simd::qacc32_to_float(acc[a], 0));
        for (int l = 0; l < simd::kLanes; ++l) sum += static_cast<int64_t>(out[l]);
      }
      for (int a = 0; a < kFmas; ++a) {
        simd::store(out, facc[a]);
        for (int l = 0; l < simd::kLanes; ++l) sum += static_cast<int64_t>(out[l]);
      }
      checksum += sum;
    }
  });
  return checksum.load();
}

// The integer dot product alone
inline int64_t qdot_peak(int64_t iters, int64_t num_threads) { return dot_loop<kAccs, 0>(iters, num_threads); }

// kMixDots dot products a round with kMixFmas multiply-adds beside them, or without: the time of the two tells how
// much of a dot product's issue slot a multiply-add takes on this CPU (model/hardware.py:
// HardwareLimits.fma_dot_share), what the 8-bit kernels' epilogue costs them (Q4_K: 4 multiply-adds per 16 dot
// products, a row and group of 32). Where the dot product is one instruction (vpdpbusd): 12 chains with 4
// multiply-adds on 32 registers, 10 with 2 on 16 (12 and their multiply-adds would spill; 8 wait on the
// instruction's latency). AVX2's three-instruction dot product spills beside them: not measured there (counts of 0).
inline constexpr bool kMixMeasured =
    std::string_view(simd::kIsa) == "avx512" || std::string_view(simd::kIsa) == "avxvnni";
inline constexpr int kMixDots = simd::kNumRegs >= 32 ? kAccs : 10;
inline constexpr int kMixFmas = simd::kNumRegs >= 32 ? 4 : 2;
inline int64_t dot_fma_mix(int64_t iters, int64_t num_threads, bool with_fmas) {
  TORCH_CHECK(kMixMeasured, "dot_fma_mix: not measured on ", simd::kIsa);
  return with_fmas ? dot_loop<kMixDots, kMixFmas>(iters, num_threads) : dot_loop<kMixDots, 0>(iters, num_threads);
}
inline std::vector<int64_t> dot_fma_mix_counts() {
  return kMixMeasured ? std::vector<int64_t>{kMixDots, kMixFmas} : std::vector<int64_t>{0, 0};
}

// integer operations one qdot_peak round of one thread does
inline int64_t qdot_peak_ops_per_iter() { return int64_t(kAccs) * int64_t(sizeof(simd::QVec)) * 2; }

// `iters` rounds of kAccs fmadd calls on each of `num_threads` workers (dot_loop's multiply-adds alone); returns a
// checksum of the sums, kLanes times the accumulators' indices.
inline int64_t fma_peak(int64_t iters, int64_t num_threads) { return dot_loop<0, kAccs>(iters, num_threads); }

// floating-point operations one fma_peak round of one thread does (a multiply-add is two)
inline int64_t fma_peak_flops_per_iter() { return int64_t(kAccs) * simd::kLanes * 2; }

}  // namespace tokenmill_peak
