// The integer dot-product peak of this CPU, as the 8-bit-activation kernels reach it: a loop that keeps its
// operands in registers and issues simd::qdot32 (vpdpbusd on AVX-512 VNNI; vpmaddubsw + vpmaddwd + vpaddd on
// AVX2) on kAccs independent accumulators, so neither memory nor one chain's latency bounds it. Every torch
// thread runs it (model/hardware.py times the call and divides the operations by the time).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace tokenmill_peak {

inline constexpr int kAccs = 12;  // independent chains: more than latency x throughput of the instruction

// `iters` rounds of kAccs qdot32 calls on each of `num_threads` workers; returns a checksum of the sums (so the
// loop cannot be dropped). Each call is sizeof(QVec) multiply-adds, two integer operations each.
inline int64_t qdot_peak(int64_t iters, int64_t num_threads) {
  TORCH_CHECK(iters > 0 && num_threads > 0, "qdot_peak: iters and num_threads must be positive");
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
      simd::QAcc32 acc[kAccs];  // distinct starting sums: kAccs chains the compiler cannot merge into one
      for (int a = 0; a < kAccs; ++a) {
        int32_t start[sizeof(simd::QAcc32) / 4];
        for (auto& v : start) v = a;
        std::memcpy(&acc[a], start, sizeof(start));
      }
      for (int64_t i = 0; i < iters; ++i)
        for (int a = 0; a < kAccs; ++a) acc[a] = simd::qdot32(acc[a], codes, x);
      float out[simd::kLanes];
      int64_t sum = 0;
      for (int a = 0; a < kAccs; ++a) {
        simd::store(out, simd::qacc32_to_float(acc[a], 0));
        for (int l = 0; l < simd::kLanes; ++l) sum += static_cast<int64_t>(out[l]);
      }
      checksum += sum;
    }
  });
  return checksum.load();
}

// integer operations one qdot_peak round of one thread does
inline int64_t qdot_peak_ops_per_iter() { return int64_t(kAccs) * int64_t(sizeof(simd::QVec)) * 2; }

}  // namespace tokenmill_peak
