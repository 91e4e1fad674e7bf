// float32 -> bfloat16 rounding as c10::BFloat16 does it, 16 lanes at a time, for the kernels whose bf16 results must
// equal ATen's bit for bit (elementwise.cpp, and amx_linear.cpp's fused SiLU-and-mul, which must equal it).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace pagedserve_native {

// The bf16 bit patterns (in the low 16 bits of each lane) nearest to v, ties to even; NaN -> quiet NaN 0x7FC0;
// subnormals kept (unlike VCVTNEPS2BF16, which flushes them).
inline __m512i bfloat16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(rounded, is_nan, _mm512_set1_epi32(0x7FC0));
}

}  // namespace pagedserve_native

#endif  // __AVX512F__
