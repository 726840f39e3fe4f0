// Vector math the kernels share (AVX-512 builds).
#pragma once
#include <cmath>

#if defined(__AVX512F__)
#include <immintrin.h>

// e^x for 16 lanes: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 Taylor polynomial (relative
// error ~2e-7, under float rounding of the softmax). x below -87 underflows to 0, as expf does.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.f), x);  // NaN in x stays NaN (max returns its second operand)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln2 in two parts: hi ...
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);        // ... and lo
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif
