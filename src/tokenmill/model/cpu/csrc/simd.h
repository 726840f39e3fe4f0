// The vector layer every kernel is written against, with one body per instruction set. The kernels (tiling,
// register blocks, prefetch) are written once in terms of `Vec` and `kLanes`; setup.py compiles them once per
// variant, and the compiler flags of that variant pick the body here:
//
//   variant  flags                                  kLanes  registers  int16 dot      u8 x s8 dot
//   avx512   -mavx512f/bw/vl/dq/vnni -mavx2 -mfma      16      32       vpdpwssd       vpdpbusd (VNNI)
//   avxvnni  -mavx2 -mfma -mf16c -mavxvnni              8      16       vpmaddwd       vpdpbusd (VEX, 256-bit)
//   avx2     -mavx2 -mfma -mf16c                        8      16       vpmaddwd       vpmaddubsw + vpmaddwd
//   base     none (portable C++: any CPU, ARM too)      4      16       plain loops    plain loops
//
// base's Vec is a GCC/Clang vector of 4 floats, which the compiler maps onto SSE2 or NEON registers. avxvnni is the
// avx2 body with its 8-bit dot products in AVX-VNNI's vpdpbusd (the CPUs that have it without AVX-512: Intel's
// since Alder Lake; AMD's Zen 5 has both). A new instruction set is a new body of these few functions, not a new
// kernel.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512VNNI__) && defined(__FMA__)
#define TOKENMILL_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TOKENMILL_AVX2 1
#if defined(__AVXVNNI__)
#define TOKENMILL_AVXVNNI 1
#endif
#include <immintrin.h>
#endif

namespace simd {

// Prefetch into L2 (prefetcht1 on x86), a no-op where the target has none.
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

#if defined(TOKENMILL_AVX512)
inline constexpr const char* kIsa = "avx512";
inline constexpr int kLanes = 16;
inline constexpr int kNumRegs = 32;

using Vec = __m512;  // the native type, not a wrapper: GCC kept arrays of a wrapper struct on the stack
inline __mmask16 first_lanes(int n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec set1(float x) { return _mm512_set1_ps(x); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load_n(const float* p, int n, float fill = 0.f) {  // lanes >= n read nothing and hold `fill`
  return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), first_lanes(n), p);
}
inline void store(float* p, Vec a) { _mm512_storeu_ps(p, a); }
inline void store_n(float* p, Vec a, int n) { _mm512_mask_storeu_ps(p, first_lanes(n), a); }
inline Vec keep_first(Vec a, int n) { return _mm512_maskz_mov_ps(first_lanes(n), a); }  // zero lanes >= n
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c
inline Vec fnmadd(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }  // b where either is NaN
inline Vec min(Vec a, Vec b) { return _mm512_min_ps(a, b); }  // b where either is NaN
inline Vec round_nearest(Vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT); }
inline Vec scale_pow2(Vec p, Vec n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral
inline float reduce_add(Vec a) { return _mm512_reduce_add_ps(a); }
inline float reduce_max(Vec a) { return _mm512_reduce_max_ps(a); }
// out[0..3] = the sums of a, b, c, d, with shared shuffles
inline void reduce_add4(Vec a, Vec b, Vec c, Vec d, float* out) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
}

// int8 dot products over int16 inputs: a step takes kDotInputs int16 inputs and as many int8 weights, and adds
// the products of each adjacent pair into one of kLanes int32 lanes.
inline constexpr int kDotInputs = 2 * kLanes;
using IVec = __m512i;
inline IVec izero() { return _mm512_setzero_si512(); }
inline IVec load_i16(const int16_t* p) { return _mm512_loadu_si512(p); }
inline IVec load_i8_as_i16(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// vpdpwssd with its accumulator tied to the output (see dpbusd below: GCC 12 copies the intrinsic's accumulator)
inline IVec dot_i16(IVec acc, IVec a, IVec b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}
inline float reduce_add_i32(IVec a) { return _mm512_reduce_add_ps(_mm512_cvtepi32_ps(a)); }

// Quantized weights to floats (quant_linear.h): kLanes bytes as signed or unsigned integers, or kLanes bytes'
// low and high nibbles as two vectors.
inline Vec i8_to_float(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void u4_to_float(const uint8_t* p, Vec& lo, Vec& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}

// 8-bit activations times 4-bit codes (quant_linear.h's int8-activation path). A QVec holds 4 * kLanes bytes: four
// consecutive inputs for each of kLanes outputs; qdot adds each output's four products of unsigned codes and
// signed activations into its int32 lane (VNNI vpdpbusd).
using QVec = __m512i;
using QAcc = __m512i;  // kLanes int32 sums
inline QAcc qacc_zero() { return _mm512_setzero_si512(); }
inline void q4_quad(const uint8_t* p, QVec& lo, QVec& hi) {  // 4 * kLanes bytes' low and high nibbles
  const __m512i b = _mm512_loadu_si512(p), m = _mm512_set1_epi8(15);
  lo = _mm512_and_si512(b, m);
  hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), m);
}
inline QVec x_quad(const int8_t* p) {  // four activations, in every output's lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
// vpdpbusd with its accumulator tied to the output. GCC 12 compiles _mm512_dpbusd_epi32 into the instruction on a
// copy of the accumulator and a copy back (two register moves per instruction); over a kernel's array of
// accumulators those moves took as many issue slots as the multiply-adds (a register-resident loop of 12 chains:
// 2.7 G instructions/s with the intrinsic, 4.8 G with this, Intel Xeon family 6 model 207).
inline __m512i dpbusd(__m512i acc, __m512i codes, __m512i x) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(codes), "v"(x));
  return acc;
}
inline QAcc qdot(QAcc acc, QVec codes, QVec x) { return dpbusd(acc, codes, x); }
inline Vec qacc_to_float(QAcc a) { return _mm512_cvtepi32_ps(a); }
// Byte codes (0..63) times 8-bit activations, in int32 lanes whatever the group (quant_linear.h's ByteQuad):
// minus `offset` (an integer per row and group, the codes' bias times the sum of the activations) before converting,
// or started at minus it (qacc32_start).
using QAcc32 = __m512i;
// int32 lanes of *neg << kShift (neg: minus a row's code sum, 2^kShift the codes' bias). The asm keeps the broadcast
// a load: GCC otherwise moves the value through a general register (load, shift, vpbroadcastd from the register),
// four instructions a row and group where two suffice: the Q6_K kernel 1.04-1.13x without them (AMD family 26).
template <int kShift>
inline QAcc32 qacc32_start(const int32_t* neg) {
  __m512i v;
  asm("vpbroadcastd %1, %0" : "=v"(v) : "m"(*neg));
  return _mm512_slli_epi32(v, kShift);
}
inline QAcc32 qdot32(QAcc32 acc, QVec codes, QVec x) { return dpbusd(acc, codes, x); }
inline Vec qacc32_to_float(QAcc32 a, int32_t offset) {
  return _mm512_cvtepi32_ps(_mm512_sub_epi32(a, _mm512_set1_epi32(offset)));
}
// Runs of quads (see the AVX2 body): vpdpbusd adds into int32 lanes at once, so a run is one quad.
inline constexpr int quad_run(int) { return 1; }
using QRun = QAcc32;
inline QRun qrun_first(QVec codes, QVec x) { return dpbusd(_mm512_setzero_si512(), codes, x); }
inline QRun qrun_add(QRun s, QVec codes, QVec x) { return dpbusd(s, codes, x); }
inline QAcc32 qrun_join(QAcc32 acc, QRun s) { return _mm512_add_epi32(acc, s); }
inline QVec byte_quad(const uint8_t* p) { return _mm512_loadu_si512(p); }
// Byte J of each output's four (a quad's input J) minus `bias`, as fp32: the exact path's reading of byte quads.
template <int J>
inline Vec quad_input(QVec w, int32_t bias) {
  __m512i b;
  if constexpr (J == 0)
    b = _mm512_and_si512(w, _mm512_set1_epi32(255));
  else if constexpr (J == 3)
    b = _mm512_srli_epi32(w, 24);
  else  // byte J of each lane to its low byte, the rest zero (a mask byte with its top bit set gives 0; vpshufb
        // indexes the bytes of its 128-bit lane, where lane element c starts at byte 4c)
    b = _mm512_shuffle_epi8(w, _mm512_set4_epi32(int32_t(0x8080800Cu | J), int32_t(0x80808008u | J),
                                                 int32_t(0x80808004u | J), int32_t(0x80808000u | J)));
  return _mm512_cvtepi32_ps(_mm512_sub_epi32(b, _mm512_set1_epi32(bias)));
}
// Wide byte quads (codes -128..127 stored plus 128: quant_linear.h's ByteQuad with kWide): vpdpbusd multiplies the
// stored bytes as they are, and the kernel takes kWideSumBias times the activations' sum back.
constexpr int32_t kWideSumBias = 128;
inline QAcc32 qdot_wide(QAcc32 acc, QVec codes, QVec x) { return dpbusd(acc, codes, x); }
// Byte quads in six or five bits a code (ByteQuad's planes: meta layouts 6 and 7, 8 and 9): two QVecs of codes in
// 6 or 5 * kLanes bytes. The low plane, one QVec, holds the first's low nibbles (low half of each byte) and the
// second's (high half); the high plane the rest of each code. Six bits: 2 * kLanes bytes of top bit pairs, byte j:
// bits 0-1 the first's byte j, 2-3 its byte j + 2 kLanes, 4-5 the second's byte j, 6-7 its byte j + 2 kLanes. Five
// bits: kLanes bytes of fifth bits, byte j: bit c the first's byte j + c kLanes (c < 4), bit 4 + c the second's.
// The high plane is broadcast to every 256-bit half (six) or 128-bit lane (five), and each 64-bit element shifts
// its bits to bit 4 (left for the first, right for the second: no bit of these crosses a byte).
template <int kCodeBits>
inline void narrow_quad(const uint8_t* p, QVec& w0, QVec& w1) {
  static_assert(kCodeBits == 6 || kCodeBits == 5, "narrow quads are six or five bits a code");
  constexpr bool kSix = kCodeBits == 6;
  const __m512i lo = _mm512_loadu_si512(p), m4 = _mm512_set1_epi8(15), top = _mm512_set1_epi8(kSix ? 0x30 : 0x10);
  const uint8_t* h = p + 4 * kLanes;
  __m512i hh, left, right;  // the broadcast high plane, each element's shifts
  if constexpr (kSix) {
    hh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
    left = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4), right = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
  } else {
    hh = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
    left = _mm512_set_epi64(1, 1, 2, 2, 3, 3, 4, 4), right = _mm512_set_epi64(3, 3, 2, 2, 1, 1, 0, 0);
  }
  w0 = _mm512_or_si512(_mm512_and_si512(lo, m4), _mm512_and_si512(_mm512_sllv_epi64(hh, left), top));
  w1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo, 4), m4),
                       _mm512_and_si512(_mm512_srlv_epi64(hh, right), top));
}
inline Vec vabs(Vec a) { return _mm512_abs_ps(a); }
// kLanes 16-bit floats as fp32: IEEE half (F16C's vcvtph2ps), bfloat16 (its bits are fp32's top half)
inline Vec load_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline Vec load_bf16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
// kLanes integral floats in [-127, 127] as int8
inline void store_i8(int8_t* p, Vec a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(a)));
}
// kLanes bytes widened to int32 lanes: signed (int8 codes), unsigned (fp8 bits)
inline __m512i load_s8_as_i32(const int8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512i load_u8_as_i32(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// Six-bit multipliers in pairs (quant_linear.h's packed K-quant scales and mins): for 2 * kLanes rows, `nib` holds
// byte r = scale r's low nibble | min r's low nibble << 4, `hi` (kLanes bytes) byte i = the top two bits of scale i,
// min i, scale i + kLanes, min i + kLanes, two bits each from bit 0. Out: the four vectors of values 0..63.
inline void six_bit_pairs(const uint8_t* nib, const uint8_t* hi, Vec& s0, Vec& s1, Vec& m0, Vec& m1) {
  const __m512i n0 = load_u8_as_i32(nib), n1 = load_u8_as_i32(nib + kLanes), h = load_u8_as_i32(hi);
  const __m512i c15 = _mm512_set1_epi32(15), c48 = _mm512_set1_epi32(48);
  s0 = _mm512_cvtepi32_ps(_mm512_or_si512(_mm512_and_si512(n0, c15), _mm512_and_si512(_mm512_slli_epi32(h, 4), c48)));
  m0 = _mm512_cvtepi32_ps(_mm512_or_si512(_mm512_srli_epi32(n0, 4), _mm512_and_si512(_mm512_slli_epi32(h, 2), c48)));
  s1 = _mm512_cvtepi32_ps(_mm512_or_si512(_mm512_and_si512(n1, c15), _mm512_and_si512(h, c48)));
  m1 = _mm512_cvtepi32_ps(_mm512_or_si512(_mm512_srli_epi32(n1, 4), _mm512_and_si512(_mm512_srli_epi32(h, 2), c48)));
}
inline Vec i32_to_float(__m512i a) { return _mm512_cvtepi32_ps(a); }
// fp8 e4m3 bits (in int32 lanes) as fp32: sign to bit 31, exponent and mantissa to bits 26..20, then times 2^120
// (the exponent biases 127 and 7 apart); a subnormal lands on an fp32 subnormal and comes out exact too
inline Vec f8e4m3_bits_to_float(__m512i x) {
  const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24),
                                       _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x7F)), 20));
  return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
}

#elif defined(TOKENMILL_AVX2)
#if defined(TOKENMILL_AVXVNNI)
inline constexpr const char* kIsa = "avxvnni";
#else
inline constexpr const char* kIsa = "avx2";
#endif
inline constexpr int kLanes = 8;
inline constexpr int kNumRegs = 16;

using Vec = __m256;
alignas(32) inline constexpr int32_t kLaneMaskTable[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
inline __m256i first_lanes(int n) {  // lanes < n all ones
  n = std::max(0, std::min(8, n));
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kLaneMaskTable + 8 - n));
}
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec set1(float x) { return _mm256_set1_ps(x); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load_n(const float* p, int n, float fill = 0.f) {  // lanes >= n read nothing and hold `fill`
  const __m256i m = first_lanes(n);
  return _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
}
inline void store(float* p, Vec a) { _mm256_storeu_ps(p, a); }
inline void store_n(float* p, Vec a, int n) { _mm256_maskstore_ps(p, first_lanes(n), a); }
inline Vec keep_first(Vec a, int n) { return _mm256_and_ps(a, _mm256_castsi256_ps(first_lanes(n))); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }
inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }  // b where either is NaN
inline Vec min(Vec a, Vec b) { return _mm256_min_ps(a, b); }  // b where either is NaN
inline Vec round_nearest(Vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p * 2^n for integral n in [-126, 128] (exp's range after its clamps): n goes straight into the exponent bits,
// 128 giving infinity.
inline Vec scale_pow2(Vec p, Vec n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline float hsum128(__m128 s) {
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_add(Vec a) { return hsum128(_mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1))); }
inline float reduce_max(Vec a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline void reduce_add4(Vec a, Vec b, Vec c, Vec d, float* out) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // per 128-bit half
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}

inline constexpr int kDotInputs = 2 * kLanes;
using IVec = __m256i;
inline IVec izero() { return _mm256_setzero_si256(); }
inline IVec load_i16(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline IVec load_i8_as_i16(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline IVec dot_i16(IVec acc, IVec a, IVec b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
inline float reduce_add_i32(IVec a) { return reduce_add(_mm256_cvtepi32_ps(a)); }

inline Vec i8_to_float(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void u4_to_float(const uint8_t* p, Vec& lo, Vec& hi) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}

using QVec = __m256i;
inline void q4_quad(const uint8_t* p, QVec& lo, QVec& hi) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), m = _mm256_set1_epi8(15);
  lo = _mm256_and_si256(b, m);
  hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
}
inline QVec x_quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
// int32 sums (QAcc32 on every 256-bit body) from a starting value; minus `offset` (the codes' bias times the
// activations' sum), as fp32: as on AVX-512
template <int kShift>
inline __m256i qacc32_start(const int32_t* neg) {
  __m256i v;
  asm("vpbroadcastd %1, %0" : "=x"(v) : "m"(*neg));
  return _mm256_slli_epi32(v, kShift);
}
inline Vec qacc32_to_float(__m256i a, int32_t offset) {
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(a, _mm256_set1_epi32(offset)));
}
#if defined(TOKENMILL_AVXVNNI)
// 8-bit activations times codes with AVX-VNNI: the AVX-512 body's int32 sums on 256-bit vectors. The {vex} prefix
// keeps the assembler from the EVEX form (AVX512-VNNI), which a CPU with AVX-VNNI alone would fault on; the asm
// ties the accumulator to the output as the AVX-512 body's does.
inline __m256i dpbusd(__m256i acc, __m256i codes, __m256i x) {
  asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(codes), "x"(x));
  return acc;
}
using QAcc = __m256i;  // kLanes int32 sums
inline QAcc qacc_zero() { return _mm256_setzero_si256(); }
inline QAcc qdot(QAcc acc, QVec codes, QVec x) { return dpbusd(acc, codes, x); }
inline Vec qacc_to_float(QAcc a) { return _mm256_cvtepi32_ps(a); }
using QAcc32 = __m256i;
inline QAcc32 qdot32(QAcc32 acc, QVec codes, QVec x) { return dpbusd(acc, codes, x); }
inline constexpr int quad_run(int) { return 1; }
using QRun = QAcc32;
inline QRun qrun_first(QVec codes, QVec x) { return dpbusd(_mm256_setzero_si256(), codes, x); }
inline QRun qrun_add(QRun s, QVec codes, QVec x) { return dpbusd(s, codes, x); }
inline QAcc32 qrun_join(QAcc32 acc, QRun s) { return _mm256_add_epi32(acc, s); }
constexpr int32_t kWideSumBias = 128;  // as on AVX-512: the stored bytes multiplied as they are
inline QAcc32 qdot_wide(QAcc32 acc, QVec codes, QVec x) { return dpbusd(acc, codes, x); }
#else
// 8-bit activations times 4-bit codes, as on AVX-512 but without VNNI: vpmaddubsw adds pairs of products into
// int16 lanes (2c, 2c+1 for output c), added up in int16 for at most 8 quads (a group of 32 inputs:
// 8 * 2 * 15 * 127 = 30,480 < 2^15, no saturation), then vpmaddwd by ones joins each output's two lanes.
using QAcc = __m256i;  // 2 * kLanes int16 sums
inline QAcc qacc_zero() { return _mm256_setzero_si256(); }
inline QAcc qdot(QAcc acc, QVec codes, QVec x) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(codes, x)); }
inline Vec qacc_to_float(QAcc a) { return _mm256_cvtepi32_ps(_mm256_madd_epi16(a, _mm256_set1_epi16(1))); }
// Byte codes (0..63) times 8-bit activations: a pair of products fits int16 (2 * 63 * 127 = 16,002) but a group's
// sum does not, so here each quad's pairs join into int32 lanes at once (vpmaddwd by ones): the peak probe's loop.
// The kernels join them once per run of quads instead (qrun_* below).
using QAcc32 = __m256i;  // kLanes int32 sums
inline QAcc32 qdot32(QAcc32 acc, QVec codes, QVec x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1)));
}
// A run of quads' pair sums added up in int16 (vpmaddubsw, vpaddw) and joined into the int32 lanes once per run (one
// vpmaddwd and vpaddd instead of one per quad): codes below 2^bits and activations within +-127 make a pair at most
// 2 * (2^bits - 1) * 127, so 4 quads of five-bit codes (31,496) or 2 of six-bit ones (32,004) stay under 2^15.
// Byte quads (8 bits a code) hold codes 0..63 too (ByteQuad's bias of 32 on Q6_K's -32..31), so they take runs of 2.
inline constexpr int quad_run(int code_bits) { return code_bits <= 5 ? 4 : 2; }
using QRun = __m256i;  // 2 * kLanes int16 sums
inline QRun qrun_first(QVec codes, QVec x) { return _mm256_maddubs_epi16(codes, x); }
inline QRun qrun_add(QRun s, QVec codes, QVec x) { return _mm256_add_epi16(s, _mm256_maddubs_epi16(codes, x)); }
inline QAcc32 qrun_join(QAcc32 acc, QRun s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(s, _mm256_set1_epi16(1)));
}
// Wide byte quads (codes -128..127 stored plus 128): a pair of products of a stored byte (up to 255) and an
// activation overflows vpmaddubsw's int16, so the code goes back to its sign (xor 128) and llama.cpp's sign trick
// multiplies |code| (unsigned, at most 128) by the activation given the code's sign: a pair at most
// 2 * 128 * 127 = 32,512. The sums carry no bias (kWideSumBias 0), each quad's pairs join the int32 lanes at once.
constexpr int32_t kWideSumBias = 0;
inline QAcc32 qdot_wide(QAcc32 acc, QVec codes, QVec x) {
  const __m256i c = _mm256_xor_si256(codes, _mm256_set1_epi8(char(0x80)));
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(x, c));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif
inline QVec byte_quad(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
template <int J>
inline Vec quad_input(QVec w, int32_t bias) {  // as on AVX-512
  __m256i b;
  if constexpr (J == 0)
    b = _mm256_and_si256(w, _mm256_set1_epi32(255));
  else if constexpr (J == 3)
    b = _mm256_srli_epi32(w, 24);
  else
    b = _mm256_shuffle_epi8(w, _mm256_setr_epi32(int32_t(0x80808000u | J), int32_t(0x80808004u | J),
                                                  int32_t(0x80808008u | J), int32_t(0x8080800Cu | J),
                                                  int32_t(0x80808000u | J), int32_t(0x80808004u | J),
                                                  int32_t(0x80808008u | J), int32_t(0x8080800Cu | J)));
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(b, _mm256_set1_epi32(bias)));
}
// Byte quads in six or five bits a code, as on AVX-512 with 128-bit halves (six) or 64-bit lanes (five).
template <int kCodeBits>
inline void narrow_quad(const uint8_t* p, QVec& w0, QVec& w1) {
  static_assert(kCodeBits == 6 || kCodeBits == 5, "narrow quads are six or five bits a code");
  constexpr bool kSix = kCodeBits == 6;
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i m4 = _mm256_set1_epi8(15), top = _mm256_set1_epi8(kSix ? 0x30 : 0x10);
  const uint8_t* h = p + 4 * kLanes;
  __m256i hh, left, right;  // the broadcast high plane, each element's shifts
  if constexpr (kSix) {
    hh = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
    left = _mm256_set_epi64x(2, 2, 4, 4), right = _mm256_set_epi64x(2, 2, 0, 0);
  } else {
    int64_t bits;
    std::memcpy(&bits, h, 8);
    hh = _mm256_set1_epi64x(bits);
    left = _mm256_set_epi64x(1, 2, 3, 4), right = _mm256_set_epi64x(3, 2, 1, 0);
  }
  w0 = _mm256_or_si256(_mm256_and_si256(lo, m4), _mm256_and_si256(_mm256_sllv_epi64(hh, left), top));
  w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo, 4), m4),
                       _mm256_and_si256(_mm256_srlv_epi64(hh, right), top));
}
inline Vec vabs(Vec a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
inline Vec load_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline Vec load_bf16(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline __m256i load_s8_as_i32(const int8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i load_u8_as_i32(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline void six_bit_pairs(const uint8_t* nib, const uint8_t* hi, Vec& s0, Vec& s1, Vec& m0, Vec& m1) {  // as AVX-512's
  const __m256i n0 = load_u8_as_i32(nib), n1 = load_u8_as_i32(nib + kLanes), h = load_u8_as_i32(hi);
  const __m256i c15 = _mm256_set1_epi32(15), c48 = _mm256_set1_epi32(48);
  s0 = _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_and_si256(n0, c15), _mm256_and_si256(_mm256_slli_epi32(h, 4), c48)));
  m0 = _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_srli_epi32(n0, 4), _mm256_and_si256(_mm256_slli_epi32(h, 2), c48)));
  s1 = _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_and_si256(n1, c15), _mm256_and_si256(h, c48)));
  m1 = _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_srli_epi32(n1, 4), _mm256_and_si256(_mm256_srli_epi32(h, 2), c48)));
}
inline Vec i32_to_float(__m256i a) { return _mm256_cvtepi32_ps(a); }
inline Vec f8e4m3_bits_to_float(__m256i x) {
  const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24),
                                       _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7F)), 20));
  return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
}
inline void store_i8(int8_t* p, Vec a) {
  const __m256i i = _mm256_cvtps_epi32(a);
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));  // 8 int16
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
}

#else  // base: portable C++ (GCC/Clang vector extensions), no intrinsics
inline constexpr const char* kIsa = "base";
inline constexpr int kLanes = 4;     // one 128-bit register of SSE2 or NEON: GCC lowers wider vectors lane by lane
inline constexpr int kNumRegs = 16;

typedef float Vec __attribute__((vector_size(4 * kLanes)));
inline Vec zero() { return Vec{}; }
inline Vec set1(float x) { return Vec{} + x; }
inline Vec load(const float* p) {
  Vec r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
inline Vec load_n(const float* p, int n, float fill = 0.f) {  // lanes >= n read nothing and hold `fill`
  Vec r = set1(fill);
  for (int i = 0; i < std::min(n, kLanes); ++i) r[i] = p[i];
  return r;
}
inline void store(float* p, Vec a) { std::memcpy(p, &a, sizeof(a)); }
inline void store_n(float* p, Vec a, int n) {
  for (int i = 0; i < std::min(n, kLanes); ++i) p[i] = a[i];
}
inline Vec keep_first(Vec a, int n) {
  for (int i = std::max(n, 0); i < kLanes; ++i) a[i] = 0.f;
  return a;
}
inline Vec add(Vec a, Vec b) { return a + b; }
inline Vec sub(Vec a, Vec b) { return a - b; }
inline Vec mul(Vec a, Vec b) { return a * b; }
inline Vec div(Vec a, Vec b) { return a / b; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return a * b + c; }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return c - a * b; }
typedef int32_t VecI32 __attribute__((vector_size(4 * kLanes)));
// As the x86 instructions: b where either is NaN. Written as vector selects and integer ops, which the compiler
// turns into SSE2 or NEON instructions (lane-by-lane calls to nearbyint/ldexp ran 20x slower).
inline Vec max(Vec a, Vec b) { return a > b ? a : b; }
inline Vec min(Vec a, Vec b) { return a < b ? a : b; }
inline Vec round_nearest(Vec a) {  // |a| < 2^22: adding and taking away 1.5 * 2^23 rounds to nearest even
  const Vec magic = set1(12582912.f);
  return (a + magic) - magic;
}
inline Vec scale_pow2(Vec p, Vec n) {  // integral n in [-126, 128], straight into the exponent bits
  const VecI32 bits = (__builtin_convertvector(n, VecI32) + 127) << 23;
  Vec scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
inline float reduce_add(Vec a) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += a[i];
  return s;
}
inline float reduce_max(Vec a) {
  float m = a[0];
  for (int i = 1; i < kLanes; ++i) m = a[i] > m ? a[i] : m;
  return m;
}
inline void reduce_add4(Vec a, Vec b, Vec c, Vec d, float* out) {
  out[0] = reduce_add(a), out[1] = reduce_add(b), out[2] = reduce_add(c), out[3] = reduce_add(d);
}

inline constexpr int kDotInputs = 2 * kLanes;
// An accumulator uses lanes [0, kLanes); loaded inputs (int16 values, widened) use all kDotInputs.
typedef int32_t IVec __attribute__((vector_size(4 * kDotInputs)));
inline IVec izero() { return IVec{}; }
inline IVec load_i16(const int16_t* p) {
  IVec r;
  for (int i = 0; i < kDotInputs; ++i) r[i] = p[i];
  return r;
}
inline IVec load_i8_as_i16(const int8_t* p) {
  IVec r;
  for (int i = 0; i < kDotInputs; ++i) r[i] = p[i];
  return r;
}
inline IVec dot_i16(IVec acc, IVec a, IVec b) {
  for (int i = 0; i < kLanes; ++i) acc[i] += a[2 * i] * b[2 * i] + a[2 * i + 1] * b[2 * i + 1];
  return acc;
}
inline float reduce_add_i32(IVec a) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += static_cast<float>(a[i]);
  return s;
}

inline Vec i8_to_float(const uint8_t* p) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r[i] = static_cast<float>(static_cast<int8_t>(p[i]));
  return r;
}
inline void u4_to_float(const uint8_t* p, Vec& lo, Vec& hi) {
  for (int i = 0; i < kLanes; ++i) lo[i] = static_cast<float>(p[i] & 15), hi[i] = static_cast<float>(p[i] >> 4);
}

// 8-bit activations times 4-bit codes in plain loops: the same int32 sums as the x86 bodies.
typedef uint8_t QVec __attribute__((vector_size(4 * kLanes)));
typedef int32_t QAcc __attribute__((vector_size(4 * kLanes)));
inline QAcc qacc_zero() { return QAcc{}; }
inline void q4_quad(const uint8_t* p, QVec& lo, QVec& hi) {
  for (int i = 0; i < 4 * kLanes; ++i) lo[i] = p[i] & 15, hi[i] = p[i] >> 4;
}
inline QVec x_quad(const int8_t* p) {
  QVec r;
  for (int i = 0; i < 4 * kLanes; ++i) r[i] = static_cast<uint8_t>(p[i % 4]);
  return r;
}
inline QAcc qdot(QAcc acc, QVec codes, QVec x) {
  for (int c = 0; c < kLanes; ++c)
    for (int i = 0; i < 4; ++i) acc[c] += int32_t(codes[4 * c + i]) * int32_t(static_cast<int8_t>(x[4 * c + i]));
  return acc;
}
inline Vec qacc_to_float(QAcc a) {
  Vec r;
  for (int c = 0; c < kLanes; ++c) r[c] = static_cast<float>(a[c]);
  return r;
}
// Byte codes times 8-bit activations: qdot's int32 sums, from a starting value, minus `offset` before converting.
using QAcc32 = QAcc;
template <int kShift>
inline QAcc32 qacc32_start(const int32_t* neg) { return QAcc{} + *neg * (1 << kShift); }
inline QAcc32 qdot32(QAcc32 acc, QVec codes, QVec x) { return qdot(acc, codes, x); }
inline Vec qacc32_to_float(QAcc32 a, int32_t offset) {
  Vec r;
  for (int c = 0; c < kLanes; ++c) r[c] = static_cast<float>(a[c] - offset);
  return r;
}
// Runs of quads (see the AVX2 body): the sums are int32 at once, a run is one quad.
inline constexpr int quad_run(int) { return 1; }
using QRun = QAcc32;
inline QRun qrun_first(QVec codes, QVec x) { return qdot(QAcc{}, codes, x); }
inline QRun qrun_add(QRun s, QVec codes, QVec x) { return qdot(s, codes, x); }
inline QAcc32 qrun_join(QAcc32 acc, QRun s) { return acc + s; }
inline QVec byte_quad(const uint8_t* p) {
  QVec r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
template <int J>
inline Vec quad_input(QVec w, int32_t bias) {  // as on AVX-512
  Vec r;
  for (int c = 0; c < kLanes; ++c) r[c] = static_cast<float>(int32_t(w[4 * c + J]) - bias);
  return r;
}
// Wide byte quads (codes -128..127 stored plus 128): int32 sums of the stored bytes, as on AVX-512.
constexpr int32_t kWideSumBias = 128;
inline QAcc32 qdot_wide(QAcc32 acc, QVec codes, QVec x) { return qdot(acc, codes, x); }
// Byte quads in six or five bits a code, as on AVX-512, byte by byte.
template <int kCodeBits>
inline void narrow_quad(const uint8_t* p, QVec& w0, QVec& w1) {
  static_assert(kCodeBits == 6 || kCodeBits == 5, "narrow quads are six or five bits a code");
  const uint8_t* h = p + 4 * kLanes;
  for (int i = 0; i < 4 * kLanes; ++i) {
    int top0, top1;  // the first's and the second's bits above the nibble
    if constexpr (kCodeBits == 6) {
      const int j = i % (2 * kLanes), s = i < 2 * kLanes ? 0 : 2;
      top0 = (h[j] >> s) & 3, top1 = (h[j] >> (s + 4)) & 3;
    } else {
      const int j = i % kLanes, c = i / kLanes;
      top0 = (h[j] >> c) & 1, top1 = (h[j] >> (c + 4)) & 1;
    }
    w0[i] = static_cast<uint8_t>((p[i] & 15) | (top0 << 4));
    w1[i] = static_cast<uint8_t>((p[i] >> 4) | (top1 << 4));
  }
}
inline Vec vabs(Vec a) {
  for (int i = 0; i < kLanes; ++i) a[i] = std::fabs(a[i]);
  return a;
}
inline Vec load_f16(const uint16_t* p) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r[i] = c10::detail::fp16_ieee_to_fp32_value(p[i]);
  return r;
}
inline Vec load_bf16(const uint16_t* p) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r[i] = c10::detail::f32_from_bits(p[i]);
  return r;
}
inline void six_bit_pairs(const uint8_t* nib, const uint8_t* hi, Vec& s0, Vec& s1, Vec& m0, Vec& m1) {
  for (int i = 0; i < kLanes; ++i) {
    const int n0 = nib[i], n1 = nib[i + kLanes], h = hi[i];
    s0[i] = float((n0 & 15) | ((h & 3) << 4)), m0[i] = float((n0 >> 4) | ((h & 12) << 2));
    s1[i] = float((n1 & 15) | (h & 48)), m1[i] = float((n1 >> 4) | ((h >> 2) & 48));
  }
}
inline void store_i8(int8_t* p, Vec a) {
  for (int i = 0; i < kLanes; ++i) p[i] = static_cast<int8_t>(a[i]);
}
#endif

// The int8 weights of a step past the end of a row: the first n (< kDotInputs) of them, zeros after, without
// reading past p + n.
inline IVec load_i8_as_i16_n(const int8_t* p, int n) {
  int8_t buf[kDotInputs] = {};
  std::memcpy(buf, p, static_cast<size_t>(std::max(0, std::min(n, kDotInputs))));
  return load_i8_as_i16(buf);
}

// e^x: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 Taylor polynomial (relative error ~2e-7,
// under float rounding of the softmax). x below -87 underflows to 0 as expf does (to ~1e-38 here); x above
// ~88.4 gives infinity. NaN stays NaN (max and min return their second operand on NaN).
inline Vec exp(Vec x) {
  x = max(set1(-87.f), x);
  x = min(set1(88.72f), x);
  const Vec n = round_nearest(mul(x, set1(1.44269504f)));
  Vec r = fnmadd(n, set1(0.693145752f), x);  // ln2 in two parts: hi ...
  r = fnmadd(n, set1(1.42860677e-6f), r);    // ... and lo
  Vec p = set1(1.f / 720);
  p = fmadd(p, r, set1(1.f / 120));
  p = fmadd(p, r, set1(1.f / 24));
  p = fmadd(p, r, set1(1.f / 6));
  p = fmadd(p, r, set1(0.5f));
  p = fmadd(p, r, set1(1.f));
  p = fmadd(p, r, set1(1.f));
  return scale_pow2(p, n);
}

// The KV cache's element types (--kv-cache-dtype): fp32, IEEE half, bfloat16, fp8 e4m3 (unscaled, as vLLM's fp8 with
// its default scale of 1) and int8 (per token and KV head: D codes, then that row's fp32 scale in 4 trailing bytes,
// so the row is D + 4 bytes wide). The 16- and 8-bit floats are kept as their bits, written rounded to nearest even
// and saturating (torch's .to(dtype) rounds and saturates the same way: the C++ decode stack and the torch layers
// write the same bits), read back exactly as fp32. An int8 row's scale is its largest magnitude / 127, its codes
// x / scale rounded to nearest even (all zero where the scale is 0); kv_format.py writes the same bytes.
enum class KvType { kF32, kF16, kBF16, kF8E4M3, kI8 };
template <KvType K>
using KvElem = std::conditional_t<
    K == KvType::kF32, float,
    std::conditional_t<K == KvType::kI8, int8_t, std::conditional_t<K == KvType::kF8E4M3, uint8_t, uint16_t>>>;
// elements a (token, KV head) row takes past its D values: int8's scale
template <KvType K>
inline constexpr int64_t kKvRowExtra = K == KvType::kI8 ? 4 : 0;

template <KvType K>
inline Vec load_kv(const KvElem<K>* p) {  // kLanes values (int8: the codes, not yet times the row's scale)
  if constexpr (K == KvType::kF32) {
    return load(p);
  } else if constexpr (K == KvType::kF16) {
    return load_f16(p);
  } else if constexpr (K == KvType::kBF16) {
    return load_bf16(p);
  } else {
#if defined(TOKENMILL_AVX512) || defined(TOKENMILL_AVX2)
    if constexpr (K == KvType::kI8)
      return i32_to_float(load_s8_as_i32(p));
    else
      return f8e4m3_bits_to_float(load_u8_as_i32(p));
#else
    Vec r;
    for (int i = 0; i < kLanes; ++i)
      r[i] = K == KvType::kI8 ? float(p[i]) : c10::detail::fp8e4m3fn_to_fp32_value(static_cast<uint8_t>(p[i]));
    return r;
#endif
  }
}
template <KvType K>
inline float kv_to_float(KvElem<K> e) {  // one value (int8: the code)
  if constexpr (K == KvType::kF32)
    return e;
  else if constexpr (K == KvType::kF16)
    return c10::detail::fp16_ieee_to_fp32_value(e);
  else if constexpr (K == KvType::kBF16)
    return c10::detail::f32_from_bits(e);
  else if constexpr (K == KvType::kF8E4M3)
    return c10::detail::fp8e4m3fn_to_fp32_value(e);
  else
    return static_cast<float>(e);
}
// the factor a row's loaded values take: an int8 row's scale (after its D codes), 1 for the other types
template <KvType K>
inline float kv_scale(const KvElem<K>* row, int64_t D) {
  if constexpr (K == KvType::kI8) {
    float s;
    std::memcpy(&s, row + D, sizeof s);
    return s;
  } else {
    return 1.f;
  }
}
// one (token, KV head) row's D values as fp32
template <KvType K>
inline void kv_row_to_float(const KvElem<K>* p, int64_t D, float* out) {
  const float s = kv_scale<K>(p, D);
  for (int64_t i = 0; i < D; ++i) out[i] = kv_to_float<K>(p[i]) * s;
}
// D fp32 values into one (token, KV head) row of the cache
template <KvType K>
inline void kv_row_from_float(const float* p, int64_t D, KvElem<K>* out) {
  if constexpr (K == KvType::kI8) {
    float amax = 0.f;
    for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(p[i]));
    const float s = amax / 127.f;
    for (int64_t i = 0; i < D; ++i)
      out[i] = s > 0.f ? static_cast<int8_t>(std::clamp(std::nearbyint(p[i] / s), -127.f, 127.f)) : int8_t(0);
    std::memcpy(out + D, &s, sizeof s);
  } else {
    for (int64_t i = 0; i < D; ++i) {
      if constexpr (K == KvType::kF32)
        out[i] = p[i];
      else if constexpr (K == KvType::kF16)
        out[i] = c10::detail::fp16_ieee_from_fp32_value(p[i]);
      else if constexpr (K == KvType::kBF16)
        out[i] = c10::detail::round_to_nearest_even(p[i]);
      else
        out[i] = c10::detail::fp8e4m3fn_from_fp32_value(p[i]);
    }
  }
}
// a token's Hkv rows (src [Hkv, D] fp32) into the cache at dst (rows D + kKvRowExtra<K> apart)
template <KvType K>
inline void kv_token_from_float(const float* src, int64_t Hkv, int64_t D, KvElem<K>* dst) {
  for (int64_t h = 0; h < Hkv; ++h) kv_row_from_float<K>(src + h * D, D, dst + h * (D + kKvRowExtra<K>));
}

}  // namespace simd
