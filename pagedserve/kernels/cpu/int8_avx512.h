// AVX-512 pieces of the W8A8 linear's byte units (int8_linear.cpp): the per-token quantization of a row and the
// 16 x 16 int32 transpose of an AMX result tile. Each equals the scalar form bit for bit: the quantization is the
// same float32 division and round-half-to-even per value (IEEE operations, no FMA), the absolute maximum is
// order-independent, and the integer sums are exact.
#pragma once

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace pagedserve_native {

// Values [i, i + 16) of a float32 or bfloat16 row as float32; lanes outside `mask` are 0.
inline __m512 load_float16(const float* x, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, x); }
inline __m512 load_float16(const uint16_t* x, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, x)), 16));
}

inline __mmask16 tail_mask16(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1);
}

// max |x[i]| over the row, NaN values skipped (as std::max(absmax, fabs(x)) does).
template <class T>
float row_absmax_avx512(const T* x, int64_t k) {
  __m512 absmax = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    const __m512 value = _mm512_abs_ps(load_float16(x + i, tail_mask16(k - i)));
    absmax = _mm512_max_ps(value, absmax);  // the second operand where either is NaN
  }
  return _mm512_reduce_max_ps(absmax);
}

// quants[i] = clamp(round_half_even(x[i] / scale), low, 127) for i < k; returns their sum.
template <class T>
int32_t quantize_row_avx512(const T* x, int64_t k, float scale, float low, int8_t* quants) {
  const __m512 divisor = _mm512_set1_ps(scale), lowest = _mm512_set1_ps(low), highest = _mm512_set1_ps(127.0f);
  __m512i sum = _mm512_setzero_si512();
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 mask = tail_mask16(k - i);
    const __m512 divided = _mm512_div_ps(load_float16(x + i, mask), divisor);
    const __m512 rounded = _mm512_roundscale_ps(divided, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i q = _mm512_cvttps_epi32(_mm512_min_ps(_mm512_max_ps(rounded, lowest), highest));
    _mm512_mask_cvtepi32_storeu_epi8(quants + i, mask, q);
    sum = _mm512_add_epi32(sum, _mm512_maskz_mov_epi32(mask, q));
  }
  return _mm512_reduce_add_epi32(sum);
}

// The lane sums of four vectors: {sum(a), sum(b), sum(c), sum(d)} (exact, wrapping int32 sums).
inline __m128i sum_lanes_4(__m512i a, __m512i b, __m512i c, __m512i d) {
  // Per 128-bit lane: a and b interleaved, then all four: [a, b, c, d] partial sums in each of the four lanes.
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  const __m512i abcd = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
  const __m256i half = _mm256_add_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
}

// rows[r] lane c <- rows[c] lane r.
inline void transpose_16x16(__m512i (&rows)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    rows[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    rows[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    rows[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    rows[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int half = 0; half < 16; half += 8)
    for (int i = 0; i < 4; ++i) {
      t[half + i] = _mm512_shuffle_i32x4(rows[half + i], rows[half + i + 4], 0x88);
      t[half + i + 4] = _mm512_shuffle_i32x4(rows[half + i], rows[half + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    rows[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    rows[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

}  // namespace pagedserve_native

#endif  // __AVX512F__ && __AVX512BW__
