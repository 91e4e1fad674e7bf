// The build's widest float32 vector as one type, for the attention kernels whose loops are written once for both
// vector levels: decode (paged_attention.cpp) and prefill (prefill_attention.cpp). FloatVector is 16 lanes on an
// AVX-512 build and 8 lanes (AVX2 + FMA, vector_avx2.h) on an AVX2 build; PAGEDSERVE_FLOAT_VECTOR says one exists.
//
// Every operation is the instruction (or fixed sequence) the AVX-512 paths used before they were written on this
// type, so an AVX-512 build computes the same bits as before. Sums over the lanes (reduce_add) are a fixed tree per
// level: a result depends on the level's lane count, never on the data's neighbours or the thread.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#include "vector_avx2.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDSERVE_FLOAT_VECTOR 1

namespace pagedserve_native {

struct FloatVector {
  using Type = __m512;
  static constexpr int kLanes = 16;
  // Vector registers of the level (the unrolled kernels size their register blocks by it).
  static constexpr int kRegisters = 32;

  static Type zero() { return _mm512_setzero_ps(); }
  static Type set1(float value) { return _mm512_set1_ps(value); }
  static Type load(const float* pointer) { return _mm512_loadu_ps(pointer); }
  // bf16 is the upper half of an fp32: widened to 32 bits and shifted into place (exact).
  static Type load(const c10::BFloat16* pointer) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pointer));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  // 2 * kLanes bf16 widened without a shuffle: `even` gets dims 2i (the low halves of the 32-bit lanes, shifted
  // up), `odd` dims 2i + 1 (the high halves, masked).
  static void load_split(const c10::BFloat16* pointer, Type& even, Type& odd) {
    const __m512i bits = _mm512_loadu_si512(pointer);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static __mmask16 first_lanes(int64_t count) {
    return count >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
  }
  // The first `count` (<= kLanes) lanes; the others zero, and not read.
  static Type load_first(const float* pointer, int64_t count) {
    return _mm512_maskz_loadu_ps(first_lanes(count), pointer);
  }
  static void store(float* pointer, Type v) { _mm512_storeu_ps(pointer, v); }
  // Writes the first `count` (<= kLanes) lanes only.
  static void store_first(float* pointer, Type v, int64_t count) {
    _mm512_mask_storeu_ps(pointer, first_lanes(count), v);
  }
  // v with the lanes from `count` on zeroed.
  static Type keep_first(Type v, int64_t count) { return _mm512_maskz_mov_ps(first_lanes(count), v); }
  static Type add(Type a, Type b) { return _mm512_add_ps(a, b); }
  static Type sub(Type a, Type b) { return _mm512_sub_ps(a, b); }
  static Type mul(Type a, Type b) { return _mm512_mul_ps(a, b); }
  static Type fmadd(Type a, Type b, Type c) { return _mm512_fmadd_ps(a, b, c); }
  static Type max(Type a, Type b) { return _mm512_max_ps(a, b); }
  static float reduce_add(Type v) { return _mm512_reduce_add_ps(v); }
  static float reduce_max(Type v) { return _mm512_reduce_max_ps(v); }
};

}  // namespace pagedserve_native

#elif defined(PAGEDSERVE_AVX2)
#define PAGEDSERVE_FLOAT_VECTOR 1

namespace pagedserve_native {

struct FloatVector {
  using Type = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kRegisters = 16;

  static Type zero() { return _mm256_setzero_ps(); }
  static Type set1(float value) { return _mm256_set1_ps(value); }
  static Type load(const float* pointer) { return load8(pointer); }
  static Type load(const c10::BFloat16* pointer) { return load8(reinterpret_cast<const uint16_t*>(pointer)); }
  static void load_split(const c10::BFloat16* pointer, Type& even, Type& odd) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pointer));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  // Masked forms only for a partial vector (VMASKMOVPS stores are slow on AMD cores).
  static Type load_first(const float* pointer, int64_t count) {
    return count >= kLanes ? load8(pointer) : load8_partial(pointer, count);
  }
  static void store(float* pointer, Type v) { store8(pointer, v); }
  static void store_first(float* pointer, Type v, int64_t count) {
    if (count >= kLanes) store8(pointer, v);
    else store8_partial(pointer, v, count);
  }
  static Type keep_first(Type v, int64_t count) {
    return count >= kLanes ? v : _mm256_and_ps(v, _mm256_castsi256_ps(first_lanes_mask(count)));
  }
  static Type add(Type a, Type b) { return _mm256_add_ps(a, b); }
  static Type sub(Type a, Type b) { return _mm256_sub_ps(a, b); }
  static Type mul(Type a, Type b) { return _mm256_mul_ps(a, b); }
  static Type fmadd(Type a, Type b, Type c) { return _mm256_fmadd_ps(a, b, c); }
  static Type max(Type a, Type b) { return _mm256_max_ps(a, b); }
  static float reduce_add(Type v) { return horizontal_sum8(v); }
  static float reduce_max(Type v) { return horizontal_max8(v); }
};

}  // namespace pagedserve_native

#endif
