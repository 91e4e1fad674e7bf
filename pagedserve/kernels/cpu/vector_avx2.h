// The AVX2 level's vector pieces (8 float lanes, FMA; no bf16 math): bf16 widened to float32 by a shift and
// rounded back as c10::BFloat16 rounds, e^x, and a horizontal sum. Used by the AVX2 paths of the kernels, which take
// them where an AVX-512 build has its 16-lane forms (exp_polynomial.h, bfloat16_rounding.h).
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define PAGEDSERVE_AVX2 1
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

// ATen's vectorised float exp on AVX2 (exported by libtorch_cpu; its Vectorized<float>::exp on an AVX2 build calls
// it). Weak: a torch build without it leaves the pointer null and exp8 uses Cephes' polynomial.
extern "C" __m256 Sleef_expf8_u10(__m256) __attribute__((weak));

namespace pagedserve_native {

// 8 floats from 8 bf16 (exact: bf16 is the upper half of a float).
inline __m256 widen_bfloat16(__m128i raw) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline __m256 load8(const float* pointer) { return _mm256_loadu_ps(pointer); }

inline __m256 load8(const uint16_t* bfloat16) {
  return widen_bfloat16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bfloat16)));
}

// The first `count` (< 8) elements, the other lanes zero.
inline __m256i first_lanes_mask(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline __m256 load8_partial(const float* pointer, int64_t count) {
  return _mm256_maskload_ps(pointer, first_lanes_mask(count));
}

inline __m256 load8_partial(const uint16_t* bfloat16, int64_t count) {
  alignas(16) uint16_t lanes[8] = {};
  std::memcpy(lanes, bfloat16, static_cast<size_t>(count) * sizeof(uint16_t));
  return widen_bfloat16(_mm_load_si128(reinterpret_cast<const __m128i*>(lanes)));
}

// The bf16 bit patterns (low 16 bits of each lane) nearest to v, ties to even; NaN -> quiet NaN 0x7FC0; subnormals
// kept: c10::BFloat16's rounding, lane by lane.
inline __m256i bfloat16_bits8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), is_nan);
}

// v rounded to the nearest bf16, as a float.
inline __m256 round_to_bfloat16(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bfloat16_bits8(v), 16)); }

// 8 bf16 from the bit patterns in the low halves of the lanes.
inline __m128i pack_bfloat16(__m256i bits) {
  const __m256i packed = _mm256_packus_epi32(bits, bits);  // per 128-bit half: 4 words, repeated
  return _mm_unpacklo_epi64(_mm256_castsi256_si128(packed), _mm256_extracti128_si256(packed, 1));
}

inline void store8(float* pointer, __m256 v) { _mm256_storeu_ps(pointer, v); }

inline void store8(uint16_t* bfloat16, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(bfloat16), pack_bfloat16(bfloat16_bits8(v)));
}

inline void store8_partial(float* pointer, __m256 v, int64_t count) {
  _mm256_maskstore_ps(pointer, first_lanes_mask(count), v);
}

inline void store8_partial(uint16_t* bfloat16, __m256 v, int64_t count) {
  alignas(16) uint16_t lanes[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes), pack_bfloat16(bfloat16_bits8(v)));
  std::memcpy(bfloat16, lanes, static_cast<size_t>(count) * sizeof(uint16_t));
}

// The first min(count, 8) elements (count >= 1), the other lanes zero: a full load when 8 are left.
inline __m256 load8_first(const float* pointer, int64_t count) {
  return count >= 8 ? load8(pointer) : load8_partial(pointer, count);
}

// The first min(count, 8) lanes of v (count >= 1) stored as bf16, rounded as bfloat16_bits8 rounds.
inline void store8_first(uint16_t* bfloat16, __m256 v, int64_t count) {
  if (count >= 8)
    store8(bfloat16, v);
  else
    store8_partial(bfloat16, v, count);
}

inline float horizontal_sum8(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}

inline float horizontal_max8(__m256 v) {
  const __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quarter = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(quarter, _mm_movehdup_ps(quarter)));
}

// Cephes expf to about 1 ulp (exp_polynomial.h's cephes_exp16 in 8 lanes; 2^n built in the exponent bits, n in
// [-126, 127] after the clamp): lanes below `lowest` give exactly 0.
inline __m256 cephes_exp8(__m256 x, float lowest, float highest) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(lowest), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(lowest)), _mm256_set1_ps(highest));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n in two halves (n up to 128 after rounding 88.8 / ln2), each a valid exponent.
  const __m256i n_int = _mm256_cvtps_epi32(n);
  const __m256i half_n = _mm256_srai_epi32(n_int, 1);
  const __m256 scale_a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half_n, _mm256_set1_epi32(127)), 23));
  const __m256 scale_b = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(n_int, half_n), _mm256_set1_epi32(127)), 23));
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(_mm256_mul_ps(p, scale_a), scale_b));
}

// exp(x) for silu: Sleef's (ATen's own on AVX2) when libtorch exports it, else Cephes' polynomial.
inline __m256 exp8(__m256 x) {
  if (Sleef_expf8_u10 != nullptr) return Sleef_expf8_u10(x);
  return cephes_exp8(x, -103.97f, 88.8f);
}

}  // namespace pagedserve_native

#endif  // __AVX2__ && __FMA__
