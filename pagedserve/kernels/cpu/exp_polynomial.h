// e^x, 16 lanes at a time, for the kernels that exponentiate in registers: decode attention's softmax
// (kernels/cpu/paged_attention.cpp) and SiLU where libtorch does not export Sleef's expf (elementwise.cpp).
// Prefill attention's softmax keeps its own 2^f polynomial (prefill_attention.cpp): its inputs are all <= 0 and its
// tests pin its bits.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace pagedserve_native {

// Cephes expf to about 1 ulp: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts), a degree-6 polynomial in r, and
// 2^n by VSCALEFPS (no integer exponent tricks: overflow gives inf). x is clamped to [lowest, highest] first, and
// lanes below `lowest` give exactly 0: each caller picks where underflow flushes (attention at ln(FLT_MIN), so that
// no result is subnormal).
inline __m512 cephes_exp16(__m512 x, float lowest, float highest) {
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(lowest), _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(lowest)), _mm512_set1_ps(highest));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow), _mm512_scalef_ps(p, n));
}

}  // namespace pagedserve_native

#endif  // __AVX512F__
