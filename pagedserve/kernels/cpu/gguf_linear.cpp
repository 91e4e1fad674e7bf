// Linear layers on GGUF-quantized weights: y[M, N] = x[M, K] @ dequantize(W)[N, K]^T (+ bias), the weight kept in
// its ggml blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) and dequantized on the fly.
//
// Python side: layers/gguf_linear.py. A batch-1 decode step is bound by the bytes it reads: a Q4_1 weight is 5 bits
// per value where float32 is 32, so keeping the blocks and decoding them in registers reads 6.4x fewer bytes.
//
// Work split and numerics:
// - Weight rows (output columns) are split between threads in units of kRows rows (kAmxColumns on the amx unit and
//   on the interleaved layouts, whose groups of 16 rows are the units); each thread walks its rows' blocks front to
//   back and decodes each block once for every input row.
// - The interleaved layouts (gguf_linear.h; run_interleaved_columns, run_amx_columns<kType, true>) give a row the
//   same bits on every unit, at every batch size and ISA level (the same exact integers, the same float operations).
// - Dequantization is ggml's reference arithmetic operation for operation (dequantize_row_* in ggml-quants.c:
//   d * q + m as a product then a sum, never a fused multiply-add; this file is compiled with fp-contract off), so
//   `gguf_dequantize` is bitwise the values model_loader/gguf_dequant.py (and llama.cpp's reference) produce.
// - Every type multiplies int16 quants of x (per row and 32-value block: d = absmax / 32767, q = round(x / d)) with
//   the weight's quants in exact int32 sums, then adds float(dot) * (d_w d_x) per block to float32 accumulators (and
//   the blocks' offset terms, m_w d_x sum(q_x), apart). Within a product unit a row's result does not depend on M,
//   the other rows or the thread count; its float summation order depends on the unit and the ISA level, so it is
//   not bitwise F.linear on the dequantized weight, nor the same bits at another level or unit: tests compare them
//   within a float tolerance plus the activation quantization's bound, at every level the machine has
//   (tests/kernels/test_isa_levels.py).
// - Up to kMaxGroupInputs input rows (4 at AVX2, 8 at AVX-512) share each decoded block.
// - The units (gguf_linear_products(); 'auto' takes amx from kAmxMinRows rows): 'vector', M <= 64:
//   run_integer_columns (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 at AVX2 and in the reference build, one block at a time),
//   run_group_columns (the same types at AVX-512, four blocks per vector), run_k_quant_columns /
//   run_k_quant_group_columns (Q4_K, Q5_K, Q6_K: 32-value sub-blocks, two at a time at AVX2, four per vector at
//   AVX-512) and run_interleaved_columns (the interleaved layouts); and at the amx level 'amx', run_amx_columns
//   (Q8_0, Q4_0, Q4_1, Q4_K: AMX-INT8 tiles, any M; its work units are 16 weight rows).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-fast-math", "fp-contract=off")
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "gguf_linear.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGEDSERVE_GGUF_AVX2 1
#endif
// The 'avx512' level and up: 16 float lanes, the integer products four blocks per vector (run_group_columns).
#if defined(PAGEDSERVE_GGUF_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGEDSERVE_GGUF_AVX512 1
#endif
// 'avx512_bf16' and up: VPDPWSSD (int16 pairs into int32) in place of VPMADDWD + VPADDD.
#if defined(PAGEDSERVE_GGUF_AVX512) && defined(__AVX512VNNI__)
#define PAGEDSERVE_GGUF_VNNI 1
#endif
// 'amx' with AMX-INT8: the 'amx' product unit (run_amx_columns).
#if defined(PAGEDSERVE_GGUF_VNNI) && defined(PAGEDSERVE_AMX) && defined(__AMX_INT8__)
#define PAGEDSERVE_GGUF_AMX 1
#endif

namespace pagedserve_native {

namespace {

constexpr int64_t kRows = 4;          // weight rows per work unit of the vector products
constexpr int64_t kMaxInputs = 64;    // largest M the vector products accept (the amx unit takes any M)
constexpr int64_t kAmxColumns = 16;   // weight rows per work unit of the amx unit (one B tile's columns)
constexpr int64_t kAmxTileRows = 16;  // input rows per A tile
constexpr const char* kAmxProducts = "amx";
constexpr const char* kVectorProducts = "vector";
constexpr int64_t kMaxBlockValues = 256;
// Input rows that share each decoded block (their accumulators stay in registers: 32 vector registers at AVX-512
// hold eight rows' accumulators beside the decoded weights, AVX2's 16 hold four).
#if defined(PAGEDSERVE_GGUF_AVX512)
constexpr int kMaxGroupInputs = 8;
#else
constexpr int kMaxGroupInputs = 4;
#endif

inline float half_to_float(const uint8_t* bytes) {
  uint16_t bits;
  std::memcpy(&bits, bytes, sizeof(bits));
#if defined(PAGEDSERVE_GGUF_AVX2)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// Q4_K / Q5_K: scale and min of sub-block j (0..7) from the 12 packed bytes (ggml's get_scale_min_k4).
inline void k_scale_min(int j, const uint8_t* q, uint8_t* scale, uint8_t* minimum) {
  if (j < 4) {
    *scale = q[j] & 63;
    *minimum = q[j + 4] & 63;
  } else {
    *scale = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    *minimum = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// The reference decoders, one block each (written so the compiler vectorises the 16- and 32-value loops).
void dequantize_q8_0(const uint8_t* block, float* out) {
  const float d = half_to_float(block);
  const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
  for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(q[i]) * d;
}

void dequantize_q4_0(const uint8_t* block, float* out) {
  const float d = half_to_float(block);
  const uint8_t* q = block + 2;
  for (int i = 0; i < 16; ++i) {
    out[i] = static_cast<float>(static_cast<int>(q[i] & 0x0F) - 8) * d;
    out[i + 16] = static_cast<float>(static_cast<int>(q[i] >> 4) - 8) * d;
  }
}

void dequantize_q4_1(const uint8_t* block, float* out) {
  const float d = half_to_float(block), m = half_to_float(block + 2);
  const uint8_t* q = block + 4;
  for (int i = 0; i < 16; ++i) {
    out[i] = static_cast<float>(q[i] & 0x0F) * d + m;
    out[i + 16] = static_cast<float>(q[i] >> 4) * d + m;
  }
}

void dequantize_q5_0(const uint8_t* block, float* out) {
  const float d = half_to_float(block);
  uint32_t high;
  std::memcpy(&high, block + 2, sizeof(high));
  const uint8_t* q = block + 6;
  for (int i = 0; i < 16; ++i) {
    const int low_fifth = static_cast<int>(((high >> i) << 4) & 0x10);
    const int high_fifth = static_cast<int>((high >> (i + 12)) & 0x10);
    out[i] = static_cast<float>(((q[i] & 0x0F) | low_fifth) - 16) * d;
    out[i + 16] = static_cast<float>(((q[i] >> 4) | high_fifth) - 16) * d;
  }
}

void dequantize_q5_1(const uint8_t* block, float* out) {
  const float d = half_to_float(block), m = half_to_float(block + 2);
  uint32_t high;
  std::memcpy(&high, block + 4, sizeof(high));
  const uint8_t* q = block + 8;
  for (int i = 0; i < 16; ++i) {
    const uint32_t low_fifth = ((high >> i) << 4) & 0x10;
    const uint32_t high_fifth = (high >> (i + 12)) & 0x10;
    out[i] = static_cast<float>((q[i] & 0x0F) | low_fifth) * d + m;
    out[i + 16] = static_cast<float>((q[i] >> 4) | high_fifth) * d + m;
  }
}

void dequantize_q4_k(const uint8_t* block, float* out) {
  const float d = half_to_float(block), dmin = half_to_float(block + 2);
  const uint8_t* scales = block + 4;
  const uint8_t* q = block + 16;
  for (int j = 0; j < 8; j += 2, q += 32, out += 64) {
    uint8_t scale, minimum;
    k_scale_min(j, scales, &scale, &minimum);
    const float d1 = d * static_cast<float>(scale), m1 = dmin * static_cast<float>(minimum);
    k_scale_min(j + 1, scales, &scale, &minimum);
    const float d2 = d * static_cast<float>(scale), m2 = dmin * static_cast<float>(minimum);
    for (int l = 0; l < 32; ++l) out[l] = d1 * static_cast<float>(q[l] & 0x0F) - m1;
    for (int l = 0; l < 32; ++l) out[l + 32] = d2 * static_cast<float>(q[l] >> 4) - m2;
  }
}

void dequantize_q5_k(const uint8_t* block, float* out) {
  const float d = half_to_float(block), dmin = half_to_float(block + 2);
  const uint8_t* scales = block + 4;
  const uint8_t* high = block + 16;
  const uint8_t* q = block + 48;
  for (int j = 0; j < 8; j += 2, q += 32, out += 64) {
    uint8_t scale, minimum;
    k_scale_min(j, scales, &scale, &minimum);
    const float d1 = d * static_cast<float>(scale), m1 = dmin * static_cast<float>(minimum);
    k_scale_min(j + 1, scales, &scale, &minimum);
    const float d2 = d * static_cast<float>(scale), m2 = dmin * static_cast<float>(minimum);
    const uint8_t bit1 = static_cast<uint8_t>(1u << j), bit2 = static_cast<uint8_t>(2u << j);
    for (int l = 0; l < 32; ++l)
      out[l] = d1 * static_cast<float>((q[l] & 0x0F) + ((high[l] & bit1) ? 16 : 0)) - m1;
    for (int l = 0; l < 32; ++l)
      out[l + 32] = d2 * static_cast<float>((q[l] >> 4) + ((high[l] & bit2) ? 16 : 0)) - m2;
  }
}

void dequantize_q6_k(const uint8_t* block, float* out) {
  const uint8_t* low = block;
  const uint8_t* high = block + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
  const float d = half_to_float(block + 208);
  for (int half = 0; half < 2; ++half, low += 64, high += 32, scales += 8, out += 128) {
    for (int l = 0; l < 32; ++l) {
      const int group = l / 16;
      const int q1 = static_cast<int>((low[l] & 0x0F) | (((high[l] >> 0) & 3) << 4)) - 32;
      const int q2 = static_cast<int>((low[l + 32] & 0x0F) | (((high[l] >> 2) & 3) << 4)) - 32;
      const int q3 = static_cast<int>((low[l] >> 4) | (((high[l] >> 4) & 3) << 4)) - 32;
      const int q4 = static_cast<int>((low[l + 32] >> 4) | (((high[l] >> 6) & 3) << 4)) - 32;
      out[l] = d * static_cast<float>(scales[group]) * static_cast<float>(q1);
      out[l + 32] = d * static_cast<float>(scales[group + 2]) * static_cast<float>(q2);
      out[l + 64] = d * static_cast<float>(scales[group + 4]) * static_cast<float>(q3);
      out[l + 96] = d * static_cast<float>(scales[group + 6]) * static_cast<float>(q4);
    }
  }
}

#if defined(PAGEDSERVE_GGUF_AVX2)
// The 32-value types decoded in registers (the same operations as the reference decoders above, 8 lanes at a time).
inline void store_scaled(__m256i quants, __m256 d, float* out) {
  _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(quants), d));
}

inline void store_affine(__m256i quants, __m256 d, __m256 m, float* out) {
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(quants), d), m));
}

void dequantize_q8_0_avx2(const uint8_t* block, float* out) {
  const __m256 d = _mm256_set1_ps(half_to_float(block));
  const uint8_t* q = block + 2;
  for (int i = 0; i < 32; i += 8)
    store_scaled(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i))), d, out + i);
}

// The 16 low nibbles (values 0..15) and 16 high nibbles (values 16..31) of a 16-byte run.
inline void nibbles(const uint8_t* q, __m128i* low, __m128i* high) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0F);
  *low = _mm_and_si128(packed, mask);
  *high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
}

void dequantize_q4_0_avx2(const uint8_t* block, float* out) {
  const __m256 d = _mm256_set1_ps(half_to_float(block));
  __m128i low, high;
  nibbles(block + 2, &low, &high);
  const __m128i eight = _mm_set1_epi8(8);
  low = _mm_sub_epi8(low, eight);
  high = _mm_sub_epi8(high, eight);
  store_scaled(_mm256_cvtepi8_epi32(low), d, out);
  store_scaled(_mm256_cvtepi8_epi32(_mm_srli_si128(low, 8)), d, out + 8);
  store_scaled(_mm256_cvtepi8_epi32(high), d, out + 16);
  store_scaled(_mm256_cvtepi8_epi32(_mm_srli_si128(high, 8)), d, out + 24);
}

void dequantize_q4_1_avx2(const uint8_t* block, float* out) {
  const __m256 d = _mm256_set1_ps(half_to_float(block)), m = _mm256_set1_ps(half_to_float(block + 2));
  __m128i low, high;
  nibbles(block + 4, &low, &high);
  store_affine(_mm256_cvtepu8_epi32(low), d, m, out);
  store_affine(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8)), d, m, out + 8);
  store_affine(_mm256_cvtepu8_epi32(high), d, m, out + 16);
  store_affine(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8)), d, m, out + 24);
}
#endif

constexpr int kQuantBlock = 32;

// x's quants span [-kQuantMax, kQuantMax] (int16: a product error ~1e-5 of the float one).
constexpr float kQuantMax = 32767.0f;

// The largest |value| of a 32-value block. A maximum is exact in any order; a NaN value is skipped, as
// std::max(absmax, NaN) skips it (MAXPS returns its second operand when either is NaN).
inline float block_absmax(const float* values) {
#if defined(PAGEDSERVE_GGUF_AVX512)
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512 low = _mm512_andnot_ps(sign, _mm512_loadu_ps(values));
  const __m512 high = _mm512_andnot_ps(sign, _mm512_loadu_ps(values + 16));
  return _mm512_reduce_max_ps(_mm512_max_ps(high, _mm512_max_ps(low, _mm512_setzero_ps())));
#elif defined(PAGEDSERVE_GGUF_AVX2)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 absmax = _mm256_setzero_ps();
  for (int i = 0; i < kQuantBlock; i += 8) absmax = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(values + i)), absmax);
  __m128 four = _mm_max_ps(_mm256_castps256_ps128(absmax), _mm256_extractf128_ps(absmax, 1));
  four = _mm_max_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_max_ss(four, _mm_movehdup_ps(four)));
#else
  float absmax = 0.0f;
  for (int i = 0; i < kQuantBlock; ++i) absmax = std::max(absmax, std::fabs(values[i]));
  return absmax;
#endif
}

void quantize_row_of_x(const float* x, int64_t k, int16_t* quants, float* scales, float* sums) {
  for (int64_t block = 0; block < k / kQuantBlock; ++block) {
    const float* values = x + block * kQuantBlock;
    int16_t* q = quants + block * kQuantBlock;
    const float absmax = block_absmax(values);
    const float d = absmax / kQuantMax, inverse = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int i = 0; i < kQuantBlock; ++i) {
      q[i] = static_cast<int16_t>(std::nearbyint(values[i] * inverse));
      sum += q[i];
    }
    scales[block] = d;
    sums[block] = d * static_cast<float>(sum);
  }
}

// The types the amx unit and the interleaved layouts take (their products are integer on every unit).
inline bool is_integer_product_type(int64_t ggml_type) {
  return ggml_type == kGgmlQ8_0 || ggml_type == kGgmlQ4_0 || ggml_type == kGgmlQ4_1;
}

// The types the amx unit takes: the interleavable ones and Q4_K (decode_k_quant_tiles).
inline bool is_amx_type(int64_t ggml_type) { return is_integer_product_type(ggml_type) || ggml_type == kGgmlQ4_K; }

// Q5_0 / Q5_1: integer products on the vector unit (run_integer_columns, run_group_columns), as Q4_0 / Q4_1's with a
// fifth bit per quant.
inline bool is_five_bit_type(int64_t ggml_type) { return ggml_type == kGgmlQ5_0 || ggml_type == kGgmlQ5_1; }

// The K-quants, whose products are integer too (run_k_quant_columns; the vector unit only).
inline bool is_k_quant_type(int64_t ggml_type) {
  return ggml_type == kGgmlQ4_K || ggml_type == kGgmlQ5_K || ggml_type == kGgmlQ6_K;
}

// The bytes of a Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 block.
template <int64_t kType>
constexpr int64_t kBlockBytes = kType == kGgmlQ8_0 ? 34 : kType == kGgmlQ4_1 ? 20 : kType == kGgmlQ5_0 ? 22
                                : kType == kGgmlQ5_1 ? 24 : 18;
// Whether the type's values are d q + m (Q4_1, Q5_1), and the zero point the others subtract (Q4_0: 8, Q5_0: 16).
template <int64_t kType>
constexpr bool kHasMin = kType == kGgmlQ4_1 || kType == kGgmlQ5_1;
template <int64_t kType>
constexpr int kZeroPoint = kType == kGgmlQ4_0 ? 8 : kType == kGgmlQ5_0 ? 16 : 0;
// Where a 32-value block's 16 nibble bytes start (after d, m and Q5's 32 fifth bits).
template <int64_t kType>
constexpr int64_t kNibbleOffset = kType == kGgmlQ4_0 ? 2 : kType == kGgmlQ4_1 ? 4 : kType == kGgmlQ5_0 ? 6 : 8;
// The 32 fifth bits of a Q5_0 / Q5_1 block (bit i: value i), after d (and m).
template <int64_t kType>
inline uint32_t fifth_bits(const uint8_t* block) {
  uint32_t bits;
  std::memcpy(&bits, block + (kType == kGgmlQ5_0 ? 2 : 4), sizeof(bits));
  return bits;
}
// The quant bytes of an interleaved group's block (gguf_linear.h): 16 rows' quants, before their d (and m).
template <int64_t kType>
constexpr int64_t kInterleavedQuantBytes = kInterleavedRows * (kType == kGgmlQ8_0 ? 32 : 16);

using BlockDecoder = void (*)(const uint8_t*, float*);

// A type's block decoder as a class, so the column loop below is compiled once per type with the decoder inlined.
template <int64_t kType, int kValues, BlockDecoder kDecode>
struct Decoder {
  static constexpr int64_t type = kType;
  static constexpr int values = kValues;
  static inline void decode(const uint8_t* block, float* out) { kDecode(block, out); }
};

#if defined(PAGEDSERVE_GGUF_AVX2)
using DecoderQ8_0 = Decoder<kGgmlQ8_0, 32, dequantize_q8_0_avx2>;
using DecoderQ4_0 = Decoder<kGgmlQ4_0, 32, dequantize_q4_0_avx2>;
using DecoderQ4_1 = Decoder<kGgmlQ4_1, 32, dequantize_q4_1_avx2>;
#else
using DecoderQ8_0 = Decoder<kGgmlQ8_0, 32, dequantize_q8_0>;
using DecoderQ4_0 = Decoder<kGgmlQ4_0, 32, dequantize_q4_0>;
using DecoderQ4_1 = Decoder<kGgmlQ4_1, 32, dequantize_q4_1>;
#endif
using DecoderQ5_0 = Decoder<kGgmlQ5_0, 32, dequantize_q5_0>;
using DecoderQ5_1 = Decoder<kGgmlQ5_1, 32, dequantize_q5_1>;
using DecoderQ4_K = Decoder<kGgmlQ4_K, 256, dequantize_q4_k>;
using DecoderQ5_K = Decoder<kGgmlQ5_K, 256, dequantize_q5_k>;
using DecoderQ6_K = Decoder<kGgmlQ6_K, 256, dequantize_q6_k>;

BlockDecoder block_decoder(int64_t ggml_type) {
  switch (ggml_type) {
    case kGgmlQ8_0: return DecoderQ8_0::decode;
    case kGgmlQ4_0: return DecoderQ4_0::decode;
    case kGgmlQ4_1: return DecoderQ4_1::decode;
    case kGgmlQ5_0: return DecoderQ5_0::decode;
    case kGgmlQ5_1: return DecoderQ5_1::decode;
    case kGgmlQ4_K: return DecoderQ4_K::decode;
    case kGgmlQ5_K: return DecoderQ5_K::decode;
    case kGgmlQ6_K: return DecoderQ6_K::decode;
    default: TORCH_CHECK(false, "gguf: ggml type ", ggml_type, " has no kernel (Q8_0=8, Q4_0=2, Q4_1=3, Q5_0=6, "
                         "Q5_1=7, Q4_K=12, Q5_K=13, Q6_K=14)");
  }
  return nullptr;
}

int64_t grain_units(int64_t row_bytes) {
  // At least ~64 KiB of weight per task: smaller tasks cost more to hand out than they take to run.
  return std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, row_bytes * kRows));
}

}  // namespace

GgmlBlockFormat ggml_block_format(int64_t ggml_type) {
  switch (block_type_of(ggml_type)) {
    case kGgmlQ8_0: return {32, 34};
    case kGgmlQ4_0: return {32, 18};
    case kGgmlQ4_1: return {32, 20};
    case kGgmlQ5_0: return {32, 22};
    case kGgmlQ5_1: return {32, 24};
    case kGgmlQ4_K: return {256, 144};
    case kGgmlQ5_K: return {256, 176};
    case kGgmlQ6_K: return {256, 210};
    default: TORCH_CHECK(false, "gguf: ggml type ", ggml_type, " has no kernel (Q8_0=8, Q4_0=2, Q4_1=3, Q5_0=6, "
                         "Q5_1=7, Q4_K=12, Q5_K=13, Q6_K=14)");
  }
  return {0, 0};
}

namespace {

// Bytes of a Q8_0 / Q4_0 / Q4_1 block's float16 header (d, and Q4_1's m) and of its quants.
struct BlockParts {
  int64_t header;
  int64_t quants;
};
inline BlockParts block_parts(int64_t block_type) {
  return block_type == kGgmlQ8_0 ? BlockParts{2, 32} : block_type == kGgmlQ4_1 ? BlockParts{4, 16} : BlockParts{2, 16};
}

// Block `block` of row `c` (0 .. 15) of an interleaved row group, as ggml's bytes (the inverse of interleave_group).
void interleaved_block(const uint8_t* group, int64_t block, int64_t c, int64_t block_type, uint8_t* out) {
  const BlockParts parts = block_parts(block_type);
  const uint8_t* blocks = group + block * kInterleavedRows * (parts.header + parts.quants);
  for (int64_t word = 0; word < parts.header / 2; ++word)
    std::memcpy(out + 2 * word, blocks + kInterleavedRows * parts.quants + 32 * word + 2 * c, 2);
  for (int64_t chunk = 0; chunk < parts.quants / 4; ++chunk)
    std::memcpy(out + parts.header + 4 * chunk, blocks + 64 * chunk + 4 * c, 4);
}

// Rows [0, 16) of `rows` (row_bytes each, ggml's layout) into `group` in the interleaved layout.
void interleave_group(const uint8_t* rows, int64_t row_bytes, int64_t block_type, uint8_t* group) {
  const BlockParts parts = block_parts(block_type);
  const int64_t block_bytes = parts.header + parts.quants;
  for (int64_t block = 0; block < row_bytes / block_bytes; ++block) {
    uint8_t* blocks = group + block * kInterleavedRows * block_bytes;
    for (int64_t c = 0; c < kInterleavedRows; ++c) {
      const uint8_t* in = rows + c * row_bytes + block * block_bytes;
      for (int64_t word = 0; word < parts.header / 2; ++word)
        std::memcpy(blocks + kInterleavedRows * parts.quants + 32 * word + 2 * c, in + 2 * word, 2);
      for (int64_t chunk = 0; chunk < parts.quants / 4; ++chunk)
        std::memcpy(blocks + 64 * chunk + 4 * c, in + parts.header + 4 * chunk, 4);
    }
  }
}

}  // namespace

at::Tensor gguf_interleave(const at::Tensor& weight, int64_t ggml_type) {
  TORCH_CHECK(ggml_type == kGgmlQ8_0 || ggml_type == kGgmlQ4_0 || ggml_type == kGgmlQ4_1,
              "gguf_interleave: Q8_0 (8), Q4_0 (2) or Q4_1 (3) blocks expected, got ggml type ", ggml_type);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                  weight.size(1) % ggml_block_format(ggml_type).bytes == 0,
              "gguf_interleave: a contiguous uint8 weight [N, bytes per row] of whole blocks expected, got ",
              weight.sizes(), " ", weight.scalar_type());
  TORCH_CHECK(weight.size(0) % kInterleavedRows == 0, "gguf_interleave: N=", weight.size(0),
              " rows is not a multiple of ", kInterleavedRows);
  at::Tensor out = at::empty_like(weight);
  const int64_t row_bytes = weight.size(1), group_bytes = kInterleavedRows * row_bytes;
  const uint8_t* in = weight.data_ptr<uint8_t>();
  uint8_t* interleaved = out.data_ptr<uint8_t>();
  at::parallel_for(0, weight.size(0) / kInterleavedRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t group = begin; group < end; ++group)
      interleave_group(in + group * group_bytes, row_bytes, ggml_type, interleaved + group * group_bytes);
  });
  return out;
}

bool gguf_interleaved_is_fast(int64_t ggml_type) {
#if defined(PAGEDSERVE_GGUF_VNNI)
  return is_interleaved_type(ggml_type + kInterleavedTypeOffset);
#elif defined(PAGEDSERVE_GGUF_AVX2)
  return is_interleaved_type(ggml_type + kInterleavedTypeOffset);  // VPMADDUBSW (Q4), VPMADDWD (Q8_0)
#else
  return false;
#endif
}

struct GgufLinearCall::State {
  const float* x = nullptr;
  int64_t x_stride = 0;
  const uint8_t* weight = nullptr;
  int64_t row_bytes = 0;
  const float* bias = nullptr;
  at::Tensor bias_tensor;
  float* y = nullptr;
  int64_t y_stride = 0;  // between y's rows: n, or more where y is a column range of a wider output
  int64_t m = 0, n = 0, k = 0;
  GgmlBlockFormat format{};
  int64_t format_type = 0;
  // The ggml type of the blocks (format_type itself, or the type an interleaved layout holds).
  int64_t block_type = 0;
  bool is_interleaved = false;
  // The 32-value integer types' products (is_integer_product): x quantized per row and 32-value block to int16
  // (d = absmax / 32767, q = round(x / d)), with each block's d and d * sum(q).
  bool is_integer_product = false;
  std::vector<int16_t> x_quants;
  std::vector<float> x_scales, x_sums;
  // The same quants in the AVX-512 products' order (group_layout_of_x): per group of four blocks and row (the rows
  // of a group side by side, so a group's rows sit at fixed offsets), 128 quants, 16 scales (each block's d four
  // times) and 4 sums; a last group short of four blocks is padded with 0.
  int64_t num_groups = 0;
  std::vector<int16_t> x_group_quants;
  std::vector<float> x_group_scales, x_group_sums;
  // The amx unit (run_amx_columns): x's int16 quants split in bytes, q = 256 high + low (high signed, low
  // unsigned), in A-tile order: per tile of tile_rows rows and 32-value block, each row's 32 high bytes then its 32
  // low bytes (64 bytes: one cache line per row, both A tiles of a block in tile_rows lines); rows padded with zeros
  // to whole tiles.
  bool is_amx = false;
  int64_t tile_rows = 0;
  std::vector<uint8_t> x_tiles;
  // The interleaved layouts' byte products (run_interleaved_columns; reads_split_quants) read x_tiles too, and per row
  // and block an integer their byte products leave over (interleaved_offsets_of_x): Q4_0's 8 sum(q_x), Q8_0's 2^15
  // sum(high bytes).
  std::vector<int32_t> x_offsets;
};

namespace {

#if defined(PAGEDSERVE_GGUF_AVX512)
// x's quants in the order group_weights decodes a weight's: per group of four blocks (block 4g + j) four vectors of
// 32 int16, vector i's 128-bit quarter j holding values 8i .. 8i + 7 of block j; beside them each block's d four
// times (quarter j's lanes) and its d * sum(q).
void group_layout_of_x(GgufLinearCall::State& s) {
  const int64_t num_blocks = s.k / kQuantBlock;
  s.num_groups = (num_blocks + 3) / 4;
  s.x_group_quants.assign(s.m * s.num_groups * 128, 0);
  s.x_group_scales.assign(s.m * s.num_groups * 16, 0.0f);
  s.x_group_sums.assign(s.m * s.num_groups * 4, 0.0f);
  for (int64_t r = 0; r < s.m; ++r) {
    for (int64_t block = 0; block < num_blocks; ++block) {
      const int64_t group = block / 4 * s.m + r, j = block % 4;  // the rows of a group side by side
      const int16_t* quants = s.x_quants.data() + (r * num_blocks + block) * kQuantBlock;
      for (int i = 0; i < 4; ++i)
        std::memcpy(s.x_group_quants.data() + group * 128 + i * 32 + j * 8, quants + 8 * i, 8 * sizeof(int16_t));
      for (int lane = 0; lane < 4; ++lane) s.x_group_scales[group * 16 + j * 4 + lane] = s.x_scales[r * num_blocks + block];
      s.x_group_sums[group * 4 + j] = s.x_sums[r * num_blocks + block];
    }
  }
}
#endif

}  // namespace

const std::vector<std::string>& gguf_linear_products() {
  static const std::vector<std::string> units = [] {
    std::vector<std::string> available;
#if defined(PAGEDSERVE_GGUF_AMX)
    if (is_amx_usable()) available.emplace_back(kAmxProducts);
#endif
    available.emplace_back(kVectorProducts);
    return available;
  }();
  return units;
}

bool gguf_amx_takes(int64_t ggml_type) {
  const std::vector<std::string>& units = gguf_linear_products();
  return is_amx_type(block_type_of(ggml_type)) &&
         std::find(units.begin(), units.end(), kAmxProducts) != units.end();
}

namespace {

// 'auto' takes the amx unit from this many input rows (benchmarks/gguf_linear_rows.py --products); on the interleaved
// layouts, whose vector products need no decoding, from more (both units give the same bits there).
constexpr int64_t kAmxMinRows = 5;
constexpr int64_t kAmxMinRowsInterleaved = 8;
// Q4_K's tiles cost more to decode (per-column sub-block scales): one decode step of the 0.82 B Q4_K_M model
// (gguf_linear_rows.py --gguf, 1 thread) took 104 / 112 ms on the amx unit at 5 / 8 rows against 81 / 100 on the
// vector one, 166 against 308 at 16.
constexpr int64_t kAmxMinRowsKQuant = 9;

// Whether this call's products run on the amx unit: `products` is 'auto', 'amx' or 'vector' (raises c10::Error for
// another name, or for 'amx' where gguf_linear_products() does not list it or the type is not an integer-product type).
bool uses_amx_products(const std::string& products, int64_t format_type, int64_t m) {
  const int64_t ggml_type = block_type_of(format_type);
  TORCH_CHECK(products == "auto" || products == kAmxProducts || products == kVectorProducts,
              "gguf_linear: products must be 'auto', 'amx' or 'vector', got '", products, "'");
  const std::vector<std::string>& units = gguf_linear_products();
  const bool has_amx = std::find(units.begin(), units.end(), kAmxProducts) != units.end();
  if (products == kAmxProducts) {
    TORCH_CHECK(has_amx, "gguf_linear: products='amx' is not available in this build or process "
                "(gguf_linear_products() lists what is)");
    TORCH_CHECK(is_amx_type(ggml_type), "gguf_linear: products='amx' takes Q8_0, Q4_0, Q4_1 or Q4_K "
                "blocks, got ggml type ", ggml_type);
    return true;
  }
  return products == "auto" && has_amx && is_amx_type(ggml_type) &&
         m >= (is_interleaved_type(format_type) ? kAmxMinRowsInterleaved
               : ggml_type == kGgmlQ4_K         ? kAmxMinRowsKQuant
                                                : kAmxMinRows);
}

// x's int16 quants as the amx unit's A tiles (State::x_tiles), rows padded to whole tiles.
void split_quants_of_x(GgufLinearCall::State& s) {
  const int64_t num_blocks = s.k / kQuantBlock;
  s.tile_rows = std::min<int64_t>(kAmxTileRows, s.m);
  const int64_t padded_m = (s.m + s.tile_rows - 1) / s.tile_rows * s.tile_rows;
  s.x_tiles.assign(padded_m * s.k * 2, 0);
  for (int64_t r = 0; r < s.m; ++r) {
    const int64_t tile = r / s.tile_rows, row = r % s.tile_rows;
    for (int64_t block = 0; block < num_blocks; ++block) {
      uint8_t* out = s.x_tiles.data() + ((tile * num_blocks + block) * s.tile_rows + row) * 2 * kQuantBlock;
      const int16_t* q = s.x_quants.data() + r * s.k + block * kQuantBlock;
      for (int i = 0; i < kQuantBlock; ++i) {
        out[i] = static_cast<uint8_t>(static_cast<uint16_t>(q[i]) >> 8);  // the high byte, read back as signed
        out[kQuantBlock + i] = static_cast<uint8_t>(q[i] & 0xFF);
      }
    }
  }
}

// The interleaved vector products' integer remainder per row and block (State::x_offsets): with the weight's quants
// as unsigned bytes (Q4: 0 .. 15; Q8_0: q + 128, for VPDPBUSD's unsigned operand), (256 high + low) products leave
// 8 sum(q_x) over Q4_0's true sum((q - 8) q_x) and 2^15 sum(high bytes) over Q8_0's.
void interleaved_offsets_of_x(GgufLinearCall::State& s) {
  const int64_t num_blocks = s.k / kQuantBlock;
  s.x_offsets.assign(s.m * num_blocks, 0);
  for (int64_t r = 0; r < s.m; ++r)
    for (int64_t block = 0; block < num_blocks; ++block) {
      const int16_t* q = s.x_quants.data() + r * s.k + block * kQuantBlock;
      int32_t sum = 0;
      for (int i = 0; i < kQuantBlock; ++i)
        sum += s.block_type == kGgmlQ4_0 ? q[i] : static_cast<int8_t>(static_cast<uint16_t>(q[i]) >> 8);
      s.x_offsets[r * num_blocks + block] = s.block_type == kGgmlQ4_0 ? 8 * sum : sum * 32768;
    }
}

// Whether the products read x's quants split in bytes (State::x_tiles, and x_offsets for Q4_0 / Q8_0): the amx unit
// and the interleaved vector products that multiply bytes (VNNI: every type; AVX2: Q4_0 and Q4_1). The others read
// x_quants as they are.
bool reads_split_quants(const GgufLinearCall::State& s) {
  if (s.is_amx) return true;
  if (!s.is_interleaved) return false;
#if defined(PAGEDSERVE_GGUF_VNNI)
  return true;
#elif defined(PAGEDSERVE_GGUF_AVX2)
  return s.block_type != kGgmlQ8_0;
#else
  return false;
#endif
}

// Checks `weight` holds [N, K / values * bytes] blocks of `ggml_type` and returns the format.
GgmlBlockFormat checked_format(const at::Tensor& weight, int64_t ggml_type, int64_t k, const char* op) {
  const GgmlBlockFormat format = ggml_block_format(ggml_type);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous(), op,
              ": a contiguous uint8 weight [N, bytes per row] expected, got ", weight.sizes(), " ",
              weight.scalar_type());
  TORCH_CHECK(k > 0 && k % format.values == 0, op, ": K=", k, " is not a multiple of the block's ", format.values,
              " values");
  TORCH_CHECK(weight.size(1) == k / format.values * format.bytes, op, ": weight rows hold ", weight.size(1),
              " bytes, K=", k, " needs ", k / format.values * format.bytes);
  TORCH_CHECK(!is_interleaved_type(ggml_type) || weight.size(0) % kInterleavedRows == 0, op, ": an interleaved ",
              "weight (type ", ggml_type, ") has a multiple of ", kInterleavedRows, " rows, got ", weight.size(0));
  return format;
}

}  // namespace

GgufLinearCall::GgufLinearCall(const at::Tensor& x, const at::Tensor& weight, int64_t ggml_type,
                               const c10::optional<at::Tensor>& bias, at::Tensor y, const std::string& products)
    : state_(std::make_unique<State>()) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "gguf_linear: a float32 x [M, K] with unit column stride expected, got ", x.sizes(), " ",
              x.scalar_type());
  State& s = *state_;
  s.format = checked_format(weight, ggml_type, x.size(1), "gguf_linear");
  s.block_type = block_type_of(ggml_type);
  s.is_interleaved = is_interleaved_type(ggml_type);
  s.is_amx = uses_amx_products(products, ggml_type, x.size(0));
  TORCH_CHECK(s.is_amx || x.size(0) <= kMaxInputs, "gguf_linear: M=", x.size(0), " exceeds ", kMaxInputs,
              " (the limit of the vector products; the amx unit, where it runs, takes any M)");
  s.format_type = ggml_type;
  s.m = x.size(0);
  s.n = weight.size(0);
  s.k = x.size(1);
  s.row_bytes = weight.size(1);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == s.n && bias->scalar_type() == at::kFloat,
                "gguf_linear: a float32 bias of ", s.n, " values expected");
    s.bias_tensor = bias->contiguous();
    s.bias = s.bias_tensor.data_ptr<float>();
  }
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.sizes() == at::IntArrayRef({s.m, s.n}) &&
                  (s.n == 1 || y.stride(1) == 1) && (s.m == 1 || y.stride(0) >= s.n),
              "gguf_linear: the output must be a float32 [", s.m, ", ", s.n, "] tensor with contiguous rows");
  s.x = x.data_ptr<float>();
  s.x_stride = x.stride(0);
  s.weight = weight.data_ptr<uint8_t>();
  s.y = y.data_ptr<float>();
  s.y_stride = s.m == 1 ? s.n : y.stride(0);
  s.is_integer_product = is_integer_product_type(s.block_type) || is_five_bit_type(s.block_type) ||
                         is_k_quant_type(s.block_type);
  if (s.is_integer_product) {
    const int64_t num_blocks = s.k / kQuantBlock;
    s.x_quants.resize(s.m * s.k);
    s.x_scales.resize(s.m * num_blocks);
    s.x_sums.resize(s.m * num_blocks);
    for (int64_t r = 0; r < s.m; ++r)
      quantize_row_of_x(s.x + r * s.x_stride, s.k, s.x_quants.data() + r * s.k, s.x_scales.data() + r * num_blocks,
                        s.x_sums.data() + r * num_blocks);
    if (reads_split_quants(s)) {
      split_quants_of_x(s);
      if (!s.is_amx && s.block_type != kGgmlQ4_1) interleaved_offsets_of_x(s);
    } else if (!s.is_interleaved) {  // the file layout's vector products (the K-quants' too)
#if defined(PAGEDSERVE_GGUF_AVX512)
      group_layout_of_x(s);
#endif
    }
  }
}

GgufLinearCall::~GgufLinearCall() = default;

int64_t GgufLinearCall::num_units() const {
  const State& s = *state_;
  const int64_t columns = s.is_amx || s.is_interleaved ? kAmxColumns : kRows;
  return s.m == 0 ? 0 : (s.n + columns - 1) / columns;
}

int64_t GgufLinearCall::grain() const {
  return grain_units(state_->row_bytes * (state_->is_amx || state_->is_interleaved ? kAmxColumns / kRows : 1));
}

namespace {

// Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 multiply integer quants (is_integer_product): the weight's quants widened to int16
// times x's int16 quants, summed in int32 (AVX2 madd). Per 32-value block of weights (d_w, m_w, q_w) and of x (d_x,
// q_x, s_x = d_x * sum(q_x)):
//   Q8_0: d_w d_x sum(q_w q_x);  Q4_0 (q_w - 8): d_w d_x sum(q_w q_x) - 8 d_w s_x;  Q4_1: d_w d_x sum(q_w q_x) + m_w s_x;
//   Q5_0 and Q5_1 as Q4_0 (with 16) and Q4_1 on 5-bit quants.
// The integer sums are exact; the float terms accumulate per block in order. The quantization of x moves a product
// by at most sum over blocks of (absmax_x / 65534) sum |w| (tests/layers/test_gguf_linear.py bounds it so): about
// 1e-5 of the product, where llama.cpp's int8 activations (Q8_1) move it ~250x more, enough to change SmolLM2's
// answers.
#if defined(PAGEDSERVE_GGUF_AVX2)
// A block's 32 weight quants as two vectors of 16 int16 (values 0..15, then 16..31).
template <int64_t kType>
inline void weight_quants(const uint8_t* block, __m256i* first, __m256i* second) {
  if constexpr (kType == kGgmlQ8_0) {
    const __m256i quants = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
    *first = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(quants));
    *second = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(quants, 1));
  } else {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kNibbleOffset<kType>));
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i low = _mm_and_si128(packed, mask);                         // values 0 .. 15
    __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);  // values 16 .. 31
    if constexpr (kType == kGgmlQ5_0 || kType == kGgmlQ5_1) {
      // 16 in byte i where bit i of the 32 fifth bits is set: byte i takes the bits' byte i / 8 (a shuffle of the
      // broadcast), then tests its bit i % 8.
      const __m256i spread = _mm256_shuffle_epi8(
          _mm256_set1_epi32(static_cast<int32_t>(fifth_bits<kType>(block))),
          _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
      const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
      const __m256i sixteens =
          _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
      low = _mm_or_si128(low, _mm256_castsi256_si128(sixteens));
      high = _mm_or_si128(high, _mm256_extracti128_si256(sixteens, 1));
    }
    *first = _mm256_cvtepu8_epi16(low);
    *second = _mm256_cvtepu8_epi16(high);
  }
}

// The sum of eight float lanes.
inline float sum_eight_lanes(__m256 v) {
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

// sum(q_w q_x) of one block, in eight int32 lanes, as float.
inline __m256 block_dot(__m256i first, __m256i second, const int16_t* x_quants) {
  const __m256i low = _mm256_madd_epi16(first, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x_quants)));
  const __m256i high = _mm256_madd_epi16(second, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x_quants + 16)));
  return _mm256_cvtepi32_ps(_mm256_add_epi32(low, high));
}
#endif

// One output element's accumulator in run_integer_columns and run_k_quant_columns: 8 float lanes with AVX2, one
// float in the reference build.
#if defined(PAGEDSERVE_GGUF_AVX2)
using RowAccumulator = __m256;
inline RowAccumulator zero_accumulator() { return _mm256_setzero_ps(); }
#else
using RowAccumulator = float;
inline RowAccumulator zero_accumulator() { return 0.0f; }
#endif

// Column `column` of y for input rows [first_input, first_input + kInputs): each row's accumulator summed, then its
// offset terms, then the bias (run_integer_columns and run_k_quant_columns).
template <int kInputs>
inline void store_column(const GgufLinearCall::State& s, int64_t first_input, int64_t column,
                         const RowAccumulator* acc, const float* offsets) {
  const float bias = s.bias != nullptr ? s.bias[column] : 0.0f;
  for (int r = 0; r < kInputs; ++r) {
#if defined(PAGEDSERVE_GGUF_AVX2)
    const float sum = sum_eight_lanes(acc[r]);
#else
    const float sum = acc[r];
#endif
    s.y[(first_input + r) * s.y_stride + column] = (sum + offsets[r]) + bias;
  }
}

template <int64_t kType, int kInputs>
void run_integer_columns(const GgufLinearCall::State& s, int64_t first_column, int64_t end_column, int64_t first_input) {
  const int64_t num_blocks = s.k / kQuantBlock, block_bytes = s.format.bytes;
  for (int64_t column = first_column; column < end_column; ++column) {
    const uint8_t* row = s.weight + column * s.row_bytes;
    float offsets[kInputs] = {};
    RowAccumulator acc[kInputs];
    for (int r = 0; r < kInputs; ++r) acc[r] = zero_accumulator();
    for (int64_t block = 0; block < num_blocks; ++block) {
      const uint8_t* weight_block = row + block * block_bytes;
      const float d = half_to_float(weight_block);
      const float m = kHasMin<kType> ? half_to_float(weight_block + 2) : 0.0f;
#if defined(PAGEDSERVE_GGUF_AVX2)
      __m256i first, second;
      weight_quants<kType>(weight_block, &first, &second);
#else
      int weight[kQuantBlock];
      uint32_t fifth = 0;  // Q5_0 / Q5_1: bit i is value i's fifth bit
      if constexpr (kType == kGgmlQ5_0 || kType == kGgmlQ5_1) fifth = fifth_bits<kType>(weight_block);
      for (int i = 0; i < kQuantBlock; ++i) {
        if constexpr (kType == kGgmlQ8_0) {
          weight[i] = reinterpret_cast<const int8_t*>(weight_block + 2)[i];
        } else {
          const uint8_t* q = weight_block + kNibbleOffset<kType>;
          weight[i] = i < 16 ? (q[i] & 0x0F) : (q[i - 16] >> 4);
          weight[i] |= static_cast<int>((fifth >> i) & 1) << 4;
        }
      }
#endif
      for (int r = 0; r < kInputs; ++r) {
        const int64_t input = first_input + r, index = input * num_blocks + block;
        const int16_t* x_block = s.x_quants.data() + index * kQuantBlock;
#if defined(PAGEDSERVE_GGUF_AVX2)
        acc[r] = _mm256_fmadd_ps(block_dot(first, second, x_block), _mm256_set1_ps(d * s.x_scales[index]), acc[r]);
#else
        int dot = 0;
        for (int i = 0; i < kQuantBlock; ++i) dot += weight[i] * x_block[i];
        acc[r] += static_cast<float>(dot) * (d * s.x_scales[index]);
#endif
        if constexpr (kHasMin<kType>) offsets[r] += m * s.x_sums[index];
        if constexpr (kZeroPoint<kType> != 0)
          offsets[r] -= static_cast<float>(kZeroPoint<kType>) * d * s.x_sums[index];
      }
    }
    store_column<kInputs>(s, first_input, column, acc, offsets);
  }
}

#if defined(PAGEDSERVE_GGUF_AVX2)
// The interleaved and K-quant products stream each thread's rows front to back, one contiguous run of blocks. The
// hardware prefetchers stop at 4 KiB page boundaries and run only a few lines ahead, so a product unit asks for the
// bytes kPrefetchBytes ahead of the block it reads (software prefetch, never a fault past the end). Batch-1 decode on
// the Emerald Rapids VM of a 560 MB Q4_1 model whose weights stream from memory (benchmarks/large_gguf.py): 36.8 -> 57
// tok/s at amx, 29.5 -> 51 at the avx2 cap (other distances at amx: 12-16 KiB 58-59, 32 KiB 54); the default model, in
// L3: 448 -> 500 tok/s at amx, 345 -> 376 at the avx2 cap (4 KiB did ~1% better there).
constexpr int64_t kPrefetchBytes = 8192;

// Prefetches the `num_bytes` bytes kPrefetchBytes past `bytes` into every cache level.
inline void prefetch_ahead(const uint8_t* bytes, int64_t num_bytes) {
  for (int64_t line = 0; line < num_bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(bytes + kPrefetchBytes + line), _MM_HINT_T0);
}
#endif

#if !defined(PAGEDSERVE_GGUF_AVX2)
// A K super-block's eight sub-blocks as int16 quants (sub-block j at 32 j), scales and offsets (the reference
// build's form of k_pair_quants and k_block_scales).
template <int64_t kType>
void k_block_quants(const uint8_t* block, int16_t quants[256], float scales[8], float offsets[8]) {
  if constexpr (kType == kGgmlQ6_K) {
    const int8_t* sixteen_scales = reinterpret_cast<const int8_t*>(block + 192);
    for (int half = 0; half < 2; ++half) {
      const uint8_t* low = block + 64 * half;
      const uint8_t* high = block + 128 + 32 * half;
      int16_t* q = quants + 128 * half;
      for (int l = 0; l < 32; ++l) {
        const int8_t* scale = sixteen_scales + 8 * half + l / 16;
        q[l] = static_cast<int16_t>((((low[l] & 0x0F) | ((high[l] & 3) << 4)) - 32) * scale[0]);
        q[l + 32] = static_cast<int16_t>((((low[l + 32] & 0x0F) | (((high[l] >> 2) & 3) << 4)) - 32) * scale[2]);
        q[l + 64] = static_cast<int16_t>((((low[l] >> 4) | (((high[l] >> 4) & 3) << 4)) - 32) * scale[4]);
        q[l + 96] = static_cast<int16_t>((((low[l + 32] >> 4) | (((high[l] >> 6) & 3) << 4)) - 32) * scale[6]);
      }
    }
    for (int j = 0; j < 8; ++j) {
      scales[j] = half_to_float(block + 208);
      offsets[j] = 0.0f;
    }
  } else {
    const float d = half_to_float(block), dmin = half_to_float(block + 2);
    const uint8_t* high = block + 16;
    const uint8_t* q = block + (kType == kGgmlQ5_K ? 48 : 16);
    for (int pair = 0; pair < 4; ++pair)
      for (int l = 0; l < 32; ++l) {
        int first = q[32 * pair + l] & 0x0F, second = q[32 * pair + l] >> 4;
        if constexpr (kType == kGgmlQ5_K) {
          first += ((high[l] >> (2 * pair)) & 1) << 4;
          second += ((high[l] >> (2 * pair + 1)) & 1) << 4;
        }
        quants[64 * pair + l] = static_cast<int16_t>(first);
        quants[64 * pair + 32 + l] = static_cast<int16_t>(second);
      }
    for (int j = 0; j < 8; ++j) {
      uint8_t scale, minimum;
      k_scale_min(j, block + 4, &scale, &minimum);
      scales[j] = d * static_cast<float>(scale);
      offsets[j] = -(dmin * static_cast<float>(minimum));
    }
  }
}
#endif

// Q4_K, Q5_K and Q6_K multiply integer quants too (is_k_quant_type): a 256-value super-block is eight 32-value
// sub-blocks, each aligned with one of x's quantization blocks, whose values are scale * q_w + offset with integer q_w:
//   Q4_K / Q5_K: q_w the 4-bit (5-bit) quant, scale d * sc_j, offset -(dmin * m_j) (ggml's d1 q - m1);
//   Q6_K: q_w = sc * (q - 32) with the int8 scale of the value's 16-value half folded in (|q_w| <= 4096), scale d.
// A sub-block's product with x's block is then scale d_x sum(q_w q_x) + offset s_x, the integer sum exact (a lane
// sums at most 8 products of |q_w| <= 4096 and |q_x| <= 32767: < 2^31), as the 32-value types' above. Each
// super-block is decoded once per weight row, in registers, for every input row of the group.
//
// AVX2 (run_k_quant_columns): two sub-blocks at a time as four vectors of 16 int16, block_dot per sub-block and
// input row. AVX-512 (run_k_quant_group_columns): half a super-block (four sub-blocks) as run_group_columns' four
// int16 vectors against x in group_layout_of_x's order, one conversion and one FMA per input row.
#if defined(PAGEDSERVE_GGUF_AVX2)
// Q4_K / Q5_K: the eight sub-blocks' scales d * sc_j and offsets -(dmin * m_j) of a super-block, lane j each.
inline void k_scales_and_offsets(const uint8_t* block, __m256* scales, __m256* offsets) {
  uint32_t word[3];
  std::memcpy(word, block + 4, sizeof(word));
  constexpr uint32_t kLowSix = 0x3F3F3F3F, kLowFour = 0x0F0F0F0F, kLowTwo = 0x03030303;
  // The 6-bit scale and min of sub-block j, four bytes per 32-bit word (ggml's get_scale_min_k4, k_scale_min above):
  // j < 4, the low six bits of bytes j and j + 4; j >= 4, the nibbles of byte j + 4 under the top two bits of bytes
  // j - 4 (scale) and j (min).
  const uint64_t scale_bytes = (word[0] & kLowSix) |
                               static_cast<uint64_t>((word[2] & kLowFour) | (((word[0] >> 6) & kLowTwo) << 4)) << 32;
  const uint64_t min_bytes = (word[1] & kLowSix) |
                             static_cast<uint64_t>(((word[2] >> 4) & kLowFour) | (((word[1] >> 6) & kLowTwo) << 4))
                                 << 32;
  const auto as_floats = [](uint64_t bytes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(bytes))));
  };
  *scales = _mm256_mul_ps(_mm256_set1_ps(half_to_float(block)), as_floats(scale_bytes));
  // -(dmin m) as (-dmin) m: the same float (negation is exact)
  *offsets = _mm256_mul_ps(_mm256_set1_ps(-half_to_float(block + 2)), as_floats(min_bytes));
}

// Bits [shift, shift + width) of every byte of `bits`, moved to bits 4 .. 4 + width (a 16-bit shift: a byte's bits
// below 8 - shift stay in it, and the mask drops what the next byte shifted in).
inline __m256i high_bits_of_bytes(__m256i bits, int shift, int width) {
  const __m256i mask = _mm256_set1_epi8(static_cast<char>((1 << width) - 1));
  return _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(bits, _mm_cvtsi32_si128(shift)), mask), 4);
}

// Sub-blocks 2 pair and 2 pair + 1 of a K super-block as 16-value int16 vectors: w[0], w[1] the first's values
// 0 .. 15 and 16 .. 31, w[2], w[3] the second's.
template <int64_t kType>
inline void k_pair_quants(const uint8_t* block, int pair, __m256i w[4]) {
  const __m256i four = _mm256_set1_epi8(0x0F);
  if constexpr (kType == kGgmlQ6_K) {
    // Half `pair / 2` of the super-block: sub-blocks (t0, t1) take the low nibbles of ql[0 .. 32) and ql[32 .. 64)
    // with qh's bits 0-1 and 2-3 above them, (t2, t3) the high nibbles with bits 4-5 and 6-7; minus 32, then times
    // the int8 scale of each 16 values (scales[v / 16] for value v of the super-block).
    const int half = pair / 2, shift = 4 * (pair % 2);
    const uint8_t* low = block + 64 * half;
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * half));
    const __m128i count = _mm_cvtsi32_si128(shift);
    const __m256i centre = _mm256_set1_epi8(32);
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192) + 4 * pair;
    for (int t = 0; t < 2; ++t) {
      const __m256i nibbles = _mm256_and_si256(
          _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + 32 * t)), count), four);
      const __m256i quants =
          _mm256_sub_epi8(_mm256_or_si256(nibbles, high_bits_of_bytes(bits, shift + 2 * t, 2)), centre);
      w[2 * t] = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(quants)),
                                    _mm256_set1_epi16(scales[2 * t]));
      w[2 * t + 1] = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(quants, 1)),
                                        _mm256_set1_epi16(scales[2 * t + 1]));
    }
  } else {
    const __m256i bytes =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + (kType == kGgmlQ5_K ? 48 : 16) + 32 * pair));
    __m256i first = _mm256_and_si256(bytes, four);                          // sub-block 2 pair
    __m256i second = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), four);  // sub-block 2 pair + 1
    if constexpr (kType == kGgmlQ5_K) {  // the fifth bit of value l of sub-block j: bit j of qh[l]
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16));
      first = _mm256_or_si256(first, high_bits_of_bytes(bits, 2 * pair, 1));
      second = _mm256_or_si256(second, high_bits_of_bytes(bits, 2 * pair + 1, 1));
    }
    w[0] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(first));
    w[1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(first, 1));
    w[2] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(second));
    w[3] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(second, 1));
  }
}

// The eight sub-blocks' scales and offsets of a super-block (k_scales_and_offsets; Q6_K: d and 0).
template <int64_t kType>
inline void k_block_scales(const uint8_t* block, __m256* scales, __m256* offsets) {
  if constexpr (kType == kGgmlQ6_K) {
    *scales = _mm256_set1_ps(half_to_float(block + 208));
    *offsets = _mm256_setzero_ps();
  } else {
    k_scales_and_offsets(block, scales, offsets);
  }
}
#endif

// Columns [first_column, end_column) of a K-quant weight for input rows [first_input, first_input + kInputs).
template <int64_t kType, int kInputs>
void run_k_quant_columns(const GgufLinearCall::State& s, int64_t first_column, int64_t end_column,
                         int64_t first_input) {
  constexpr bool kHasOffsets = kType != kGgmlQ6_K;
  const int64_t num_blocks = s.k / kQuantBlock, num_super_blocks = s.k / 256, block_bytes = s.format.bytes;
  for (int64_t column = first_column; column < end_column; ++column) {
    const uint8_t* row = s.weight + column * s.row_bytes;
    float offsets[kInputs] = {};
    RowAccumulator acc[kInputs];
    for (int r = 0; r < kInputs; ++r) acc[r] = zero_accumulator();
    for (int64_t super_block = 0; super_block < num_super_blocks; ++super_block) {
      const uint8_t* block = row + super_block * block_bytes;
#if defined(PAGEDSERVE_GGUF_AVX2)
      prefetch_ahead(block, block_bytes);
      alignas(32) float scales[8], block_offsets[8];
      __m256 scale_vector, offset_vector;
      k_block_scales<kType>(block, &scale_vector, &offset_vector);
      _mm256_store_ps(scales, scale_vector);
      _mm256_store_ps(block_offsets, offset_vector);
      for (int pair = 0; pair < 4; ++pair) {
        __m256i w[4];
        k_pair_quants<kType>(block, pair, w);
        for (int half = 0; half < 2; ++half) {
          const int j = 2 * pair + half;
          for (int r = 0; r < kInputs; ++r) {
            const int64_t index = (first_input + r) * num_blocks + 8 * super_block + j;
            acc[r] = _mm256_fmadd_ps(block_dot(w[2 * half], w[2 * half + 1], s.x_quants.data() + index * kQuantBlock),
                                     _mm256_set1_ps(scales[j] * s.x_scales[index]), acc[r]);
            if constexpr (kHasOffsets) offsets[r] += block_offsets[j] * s.x_sums[index];
          }
        }
      }
#else
      int16_t quants[256];
      float scales[8], block_offsets[8];
      k_block_quants<kType>(block, quants, scales, block_offsets);
      for (int j = 0; j < 8; ++j)
        for (int r = 0; r < kInputs; ++r) {
          const int64_t index = (first_input + r) * num_blocks + 8 * super_block + j;
          const int16_t* x_block = s.x_quants.data() + index * kQuantBlock;
          int dot = 0;
          for (int i = 0; i < kQuantBlock; ++i) dot += quants[32 * j + i] * x_block[i];
          acc[r] += static_cast<float>(dot) * (scales[j] * s.x_scales[index]);
          if constexpr (kHasOffsets) offsets[r] += block_offsets[j] * s.x_sums[index];
        }
#endif
    }
    store_column<kInputs>(s, first_input, column, acc, offsets);
  }
}

#if defined(PAGEDSERVE_GGUF_AVX512)
// The AVX-512 integer products: four consecutive blocks of a weight row per vector, so one int32 vector holds four
// blocks' dot products (four lanes each) and the per-block scales apply as vectors, with no horizontal sum per block:
// per input row and group of four blocks, four VPDPWSSD (VPMADDWD + VPADDD at 'avx512') on x's quants in the same
// order (group_layout_of_x), one conversion, one product of scales, one FMA (and one 4-lane FMA for Q4_1's m_w s_x).
// The weight's decoding (nibbles or bytes to int16, scales from float16) is shared by every input row of the group.
//
// VPDPWSSD rather than VPDPBUSD: int16 x splits into a signed high byte and an unsigned low byte (x = 256 hi + lo),
// and u8 x s8 needs the low byte signed too, so a 32-value block takes two VPDPBUSD and a shift per row where
// VPDPWSSD takes one (the byte form saves only the weight's widening, which every row of the group shares).
//
// Per lane: eight products of |q_w| <= 128 and |q_x| <= 32767 sum to < 2^26 in int32 (exact); Q4_0's quants are
// q - 8, so its product is d_w d_x sum((q_w - 8) q_x) with no offset term. A lane's int32 converts to float exactly
// below 2^24 (every Q4 lane; Q8_0 lanes past it round by the last bit). Float order per output: 16 lane
// accumulators (lane 4j + t: block 4g + j's pair sums), each adding its block's float(dot) * (d_w * d_x) per group,
// then _mm512_reduce_add_ps, then + the 4-lane m_w s_x sum (Q4_1), then + bias: it depends on K only.
//
// A group of four blocks of `kType` as four int16 vectors (quarter j of vector i: values 8i .. 8i + 7 of block j),
// the blocks' d_w each four times (quarter j's lanes) and for Q4_1 their m_w. Blocks past `num_valid` read as 0.
// kFull: a whole group (num_valid == 4), read with plain loads (every load stays inside its 72 to 136 bytes).
template <int64_t kType, bool kFull>
__attribute__((always_inline)) inline void group_weights(const uint8_t* group, int num_valid, __m512i weight[4], __m512* d, __m128* m) {
  constexpr int64_t kBytes = kBlockBytes<kType>;
  const auto valid_bytes = [num_valid](int64_t offset) -> __mmask64 {
    if constexpr (kFull) return ~__mmask64{0};
    const int64_t count = std::max<int64_t>(0, std::min<int64_t>(64, num_valid * kBytes - offset));
    return count == 64 ? ~__mmask64{0} : ((__mmask64{1} << count) - 1);
  };
  const auto load_bytes = [&valid_bytes](const uint8_t* p, int64_t offset) {
    return kFull ? _mm512_loadu_si512(p + offset) : _mm512_maskz_loadu_epi8(valid_bytes(offset), p + offset);
  };
  const auto load_run = [num_valid](const uint8_t* p, int j) {  // block j's 16 quant bytes (Q4)
    return kFull ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)) : _mm_maskz_loadu_epi8(num_valid > j ? 0xFFFF : 0, p);
  };
  if constexpr (kType == kGgmlQ8_0) {
    __m512i widened[4];
    for (int j = 0; j < 4; ++j) {
      const __m256i bytes = kFull ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + j * kBytes + 2))
                                  : _mm256_maskz_loadu_epi8(j < num_valid ? ~__mmask32{0} : 0, group + j * kBytes + 2);
      widened[j] = _mm512_cvtepi8_epi16(bytes);
    }
    // A 4 x 4 transpose of 128-bit quarters: vector i takes quarter i of each block.
    const __m512i t0 = _mm512_shuffle_i64x2(widened[0], widened[1], 0x44);
    const __m512i t1 = _mm512_shuffle_i64x2(widened[0], widened[1], 0xEE);
    const __m512i t2 = _mm512_shuffle_i64x2(widened[2], widened[3], 0x44);
    const __m512i t3 = _mm512_shuffle_i64x2(widened[2], widened[3], 0xEE);
    weight[0] = _mm512_shuffle_i64x2(t0, t2, 0x88);
    weight[1] = _mm512_shuffle_i64x2(t0, t2, 0xDD);
    weight[2] = _mm512_shuffle_i64x2(t1, t3, 0x88);
    weight[3] = _mm512_shuffle_i64x2(t1, t3, 0xDD);
    // d of block j is the float16 at byte 34 j: words 0, 17, 34, 51 of the group's first 128 bytes.
    const __m512i low = load_bytes(group, 0);
    const __m512i high = load_bytes(group, 64);
    const __m512i index = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 51, 51, 51, 51, 34, 34, 34,
                                           34, 17, 17, 17, 17, 0, 0, 0, 0);
    *d = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi16(low, index, high)));
  } else {
    constexpr int64_t kQuantOffset = kNibbleOffset<kType>;
    __m512i packed = _mm512_castsi128_si512(load_run(group + kQuantOffset, 0));
    packed = _mm512_inserti32x4(packed, load_run(group + kBytes + kQuantOffset, 1), 1);
    packed = _mm512_inserti32x4(packed, load_run(group + 2 * kBytes + kQuantOffset, 2), 2);
    packed = _mm512_inserti32x4(packed, load_run(group + 3 * kBytes + kQuantOffset, 3), 3);
    const __m512i mask = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
    __m512i low = _mm512_and_si512(packed, mask);                         // values 0 .. 15 of each block
    __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), mask);  // values 16 .. 31
    if constexpr (kType == kGgmlQ5_0 || kType == kGgmlQ5_1) {
      // + 16 on the bytes whose fifth bit is set: block j's bits 0 .. 15 (values 0 .. 15) mask quarter j of low,
      // bits 16 .. 31 quarter j of high.
      uint64_t low_bits = 0, high_bits = 0;
      for (int j = 0; j < 4; ++j) {
        if (!kFull && j >= num_valid) break;
        const uint64_t bits = fifth_bits<kType>(group + j * kBytes);
        low_bits |= (bits & 0xFFFF) << (16 * j);
        high_bits |= (bits >> 16) << (16 * j);
      }
      const __m512i sixteen = _mm512_set1_epi8(16);
      low = _mm512_mask_add_epi8(low, low_bits, low, sixteen);
      high = _mm512_mask_add_epi8(high, high_bits, high, sixteen);
    }
    weight[0] = _mm512_unpacklo_epi8(low, zero);
    weight[1] = _mm512_unpackhi_epi8(low, zero);
    weight[2] = _mm512_unpacklo_epi8(high, zero);
    weight[3] = _mm512_unpackhi_epi8(high, zero);
    if constexpr (kZeroPoint<kType> != 0) {
      const __m512i zero_point = _mm512_set1_epi16(kZeroPoint<kType>);
      for (int i = 0; i < 4; ++i) weight[i] = _mm512_sub_epi16(weight[i], zero_point);
    }
    // d (and m) of block j are the float16 words at byte kBytes j (and + 2): in the group's first 64 bytes (Q4), or
    // its first 128 (Q5).
    const __m512i header = load_bytes(group, 0);
    const __m512i header_high = 3 * kBytes + 4 > 64 ? load_bytes(group, 64) : header;
    constexpr short kWords = kBytes / 2;
    const __m512i d_index = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3 * kWords, 3 * kWords,
                                             3 * kWords, 3 * kWords, 2 * kWords, 2 * kWords, 2 * kWords, 2 * kWords,
                                             kWords, kWords, kWords, kWords, 0, 0, 0, 0);
    *d = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi16(header, d_index, header_high)));
    if constexpr (kHasMin<kType>) {
      const __m512i m_index = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                               0, 0, 0, 0, 3 * kWords + 1, 2 * kWords + 1, kWords + 1, 1);
      *m = _mm_cvtph_ps(_mm512_castsi512_si128(_mm512_permutex2var_epi16(header, m_index, header_high)));
    }
  }
}

// sum(q_w q_x) of a group's four blocks for one input row: quarter j of the result holds block j's four lanes.
__attribute__((always_inline)) inline __m512i group_dot(const __m512i weight[4], const int16_t* x_quants) {
  const auto x = [x_quants](int i) { return _mm512_loadu_si512(x_quants + 32 * i); };
#if defined(PAGEDSERVE_GGUF_VNNI)
  __m512i sum = _mm512_madd_epi16(weight[0], x(0));
  sum = _mm512_dpwssd_epi32(sum, weight[1], x(1));
  sum = _mm512_dpwssd_epi32(sum, weight[2], x(2));
  return _mm512_dpwssd_epi32(sum, weight[3], x(3));
#else
  const __m512i first = _mm512_add_epi32(_mm512_madd_epi16(weight[0], x(0)), _mm512_madd_epi16(weight[1], x(1)));
  const __m512i second = _mm512_add_epi32(_mm512_madd_epi16(weight[2], x(2)), _mm512_madd_epi16(weight[3], x(3)));
  return _mm512_add_epi32(first, second);
#endif
}

// Group `group` of weight row `row` times input rows [0, kInputs) of this call's x: each row's dot products into
// its accumulator (and Q4_1's m_w s_x into its offsets), the blocks' float terms added in order.
template <int64_t kType, int kInputs, bool kFull>
__attribute__((always_inline)) inline void group_products(const uint8_t* row, int64_t group, int num_valid,
                                                          int64_t block_bytes, int64_t m, const int16_t* x_quants,
                                                          const float* x_scales, const float* x_sums,
                                                          __m512* acc, __m128* offsets) {
  __m512i weight[4];
  __m512 d;
  __m128 mins = _mm_setzero_ps();
  group_weights<kType, kFull>(row + 4 * group * block_bytes, num_valid, weight, &d, &mins);
  const int16_t* const group_quants = x_quants + group * m * 128;
  const float* const group_scales = x_scales + group * m * 16;
  const float* const group_sums = x_sums + group * m * 4;
  for (int r = 0; r < kInputs; ++r) {
    const __m512 dot = _mm512_cvtepi32_ps(group_dot(weight, group_quants + r * 128));
    acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_loadu_ps(group_scales + r * 16)), acc[r]);
    if constexpr (kHasMin<kType>) offsets[r] = _mm_fmadd_ps(mins, _mm_loadu_ps(group_sums + r * 4), offsets[r]);
  }
}

// Every group of weight row `row` (whole groups with plain loads, a last partial one masked), group after group.
template <int64_t kType, int kInputs>
__attribute__((always_inline)) inline void row_products(const GgufLinearCall::State& s, const uint8_t* row,
                                                        const int16_t* x_quants, const float* x_scales,
                                                        const float* x_sums, __m512* acc, __m128* offsets) {
  const int64_t num_blocks = s.k / kQuantBlock, num_full = num_blocks / 4;
  for (int64_t group = 0; group < num_full; ++group)
    group_products<kType, kInputs, true>(row, group, 4, s.format.bytes, s.m, x_quants, x_scales, x_sums, acc,
                                         offsets);
  if (num_full < s.num_groups)
    group_products<kType, kInputs, false>(row, num_full, static_cast<int>(num_blocks - 4 * num_full), s.format.bytes,
                                          s.m, x_quants, x_scales, x_sums, acc, offsets);
}

// Column `column` of y for input rows [first_input, first_input + kInputs) of the four-blocks-per-vector products:
// each row's 16 lanes summed, then (kHasOffsets) its 4 lanes of offset terms, then the bias.
template <int kInputs, bool kHasOffsets>
inline void store_group_column(const GgufLinearCall::State& s, int64_t first_input, int64_t column, const __m512* acc,
                               const __m128* offsets) {
  const float bias = s.bias != nullptr ? s.bias[column] : 0.0f;
  for (int r = 0; r < kInputs; ++r) {
    float sum = _mm512_reduce_add_ps(acc[r]);
    if constexpr (kHasOffsets) {
      const __m128 pair = _mm_add_ps(offsets[r], _mm_movehl_ps(offsets[r], offsets[r]));
      sum += _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
    }
    s.y[(first_input + r) * s.y_stride + column] = sum + bias;
  }
}

template <int64_t kType, int kInputs>
void run_group_columns(const GgufLinearCall::State& s, int64_t first_column, int64_t end_column, int64_t first_input) {
  // Locals, so the stores to y do not make the compiler reload them; group g's row r is at index g * M + r.
  const int16_t* const x_quants = s.x_group_quants.data() + first_input * 128;
  const float* const x_scales = s.x_group_scales.data() + first_input * 16;
  const float* const x_sums = s.x_group_sums.data() + first_input * 4;
  // One weight row at a time, front to back: one sequential stream per thread (interleaving several rows' groups,
  // though cheaper in arithmetic, read the weights markedly slower in a batch-1 decode).
  for (int64_t column = first_column; column < end_column; ++column) {
    __m512 acc[kInputs];
    __m128 offsets[kInputs];
    for (int r = 0; r < kInputs; ++r) {
      acc[r] = _mm512_setzero_ps();
      offsets[r] = _mm_setzero_ps();
    }
    row_products<kType, kInputs>(s, s.weight + column * s.row_bytes, x_quants, x_scales, x_sums, acc, offsets);
    store_group_column<kInputs, kHasMin<kType>>(s, first_input, column, acc, offsets);
  }
}

// The AVX-512 K-quant products: half a super-block (sub-blocks 4 half .. 4 half + 3, x's group 2 super-block + half)
// in group_weights' layout, so each input row takes group_dot, one conversion and one FMA per four sub-blocks.
// Vector i's quarter j holds values 8i .. 8i + 7 of sub-block 4 half + j (int16); d (lanes 4j .. 4j + 3) and m
// (lane j) its scale and offset.
template <int64_t kType>
__attribute__((always_inline)) inline void k_group_weights(const uint8_t* block, int half, __m256 scales,
                                                           __m256 offsets, __m512i weight[4], __m512* d, __m128* m) {
  const __m512i four = _mm512_set1_epi8(0x0F);
  // 64 quant bytes each, 32 per sub-block. Q4_K / Q5_K: first the low nibbles (sub-blocks 0 and 2 of the half),
  // second the high ones (1 and 3). Q6_K: first the low nibbles (t0, t1), second the high (t2, t3).
  __m512i first, second, order_first, order_second;
  if constexpr (kType == kGgmlQ6_K) {
    const __m512i bytes = _mm512_loadu_si512(block + 64 * half);
    const __m512i bits =
        _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * half)));
    // qh's bits 0-1 (t0), 2-3 (t1), 4-5 (t2), 6-7 (t3) under the nibbles: 16-bit shifts by lane, masked per byte.
    const __m512i low_shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i high_shift = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    const __m512i two = _mm512_set1_epi8(3), centre = _mm512_set1_epi8(32);
    const auto sixes = [&](__m512i nibbles, __m512i shift) {
      const __m512i top = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(bits, shift), two), 4);
      return _mm512_sub_epi8(_mm512_or_si512(nibbles, top), centre);
    };
    first = sixes(_mm512_and_si512(bytes, four), low_shift);
    second = sixes(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), four), high_shift);
    // quarter j of vector i: first's 8-byte word i (j = 0), 4 + i (j = 1), then second's (j = 2, 3)
    order_first = _mm512_set_epi64(13, 9, 5, 1, 12, 8, 4, 0);
    order_second = _mm512_set_epi64(15, 11, 7, 3, 14, 10, 6, 2);
  } else {
    const __m512i bytes = _mm512_loadu_si512(block + (kType == kGgmlQ5_K ? 48 : 16) + 64 * half);
    first = _mm512_and_si512(bytes, four);
    second = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), four);
    if constexpr (kType == kGgmlQ5_K) {  // + 16 where bit (sub-block) of qh[l] is set
      const __m512i bits = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16)));
      const auto bit = [](int j) { return static_cast<char>(1 << j); };
      const __m512i sixteen = _mm512_set1_epi8(16);
      const __m512i first_bits =
          _mm512_inserti64x4(_mm512_set1_epi8(bit(4 * half)), _mm256_set1_epi8(bit(4 * half + 2)), 1);
      const __m512i second_bits =
          _mm512_inserti64x4(_mm512_set1_epi8(bit(4 * half + 1)), _mm256_set1_epi8(bit(4 * half + 3)), 1);
      first = _mm512_mask_add_epi8(first, _mm512_test_epi8_mask(bits, first_bits), first, sixteen);
      second = _mm512_mask_add_epi8(second, _mm512_test_epi8_mask(bits, second_bits), second, sixteen);
    }
    // quarter j of vector i: first's word i (j = 0), second's word i (j = 1), first's 4 + i, second's 4 + i
    order_first = _mm512_set_epi64(13, 5, 9, 1, 12, 4, 8, 0);
    order_second = _mm512_set_epi64(15, 7, 11, 3, 14, 6, 10, 2);
  }
  const __m512i values_01 = _mm512_permutex2var_epi64(first, order_first, second);   // vectors 0, 1
  const __m512i values_23 = _mm512_permutex2var_epi64(first, order_second, second);  // vectors 2, 3
  const auto widen = [](__m256i bytes) {
    return kType == kGgmlQ6_K ? _mm512_cvtepi8_epi16(bytes) : _mm512_cvtepu8_epi16(bytes);
  };
  weight[0] = widen(_mm512_castsi512_si256(values_01));
  weight[1] = widen(_mm512_extracti64x4_epi64(values_01, 1));
  weight[2] = widen(_mm512_castsi512_si256(values_23));
  weight[3] = widen(_mm512_extracti64x4_epi64(values_23, 1));
  if constexpr (kType == kGgmlQ6_K) {
    // values 0 .. 15 of sub-block 4 half + j take scale 8 half + 2j, values 16 .. 31 scale 8 half + 2j + 1
    const __m512i sixteen_scales = _mm512_castsi128_si512(
        _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 192 + 8 * half))));
    const __m512i first_half = _mm512_set_epi16(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2, 2, 2,
                                                0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i low_scales = _mm512_permutexvar_epi16(first_half, sixteen_scales);
    const __m512i high_scales = _mm512_permutexvar_epi16(_mm512_add_epi16(first_half, _mm512_set1_epi16(1)),
                                                         sixteen_scales);
    weight[0] = _mm512_mullo_epi16(weight[0], low_scales);
    weight[1] = _mm512_mullo_epi16(weight[1], low_scales);
    weight[2] = _mm512_mullo_epi16(weight[2], high_scales);
    weight[3] = _mm512_mullo_epi16(weight[3], high_scales);
  }
  const __m512i lanes = _mm512_add_epi32(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                         _mm512_set1_epi32(4 * half));
  *d = _mm512_permutexvar_ps(lanes, _mm512_castps256_ps512(scales));
  *m = half == 0 ? _mm256_castps256_ps128(offsets) : _mm256_extractf128_ps(offsets, 1);
}

template <int64_t kType, int kInputs>
void run_k_quant_group_columns(const GgufLinearCall::State& s, int64_t first_column, int64_t end_column,
                               int64_t first_input) {
  constexpr bool kHasOffsets = kType != kGgmlQ6_K;
  const int16_t* const x_quants = s.x_group_quants.data() + first_input * 128;
  const float* const x_scales = s.x_group_scales.data() + first_input * 16;
  const float* const x_sums = s.x_group_sums.data() + first_input * 4;
  const int64_t num_super_blocks = s.k / 256, block_bytes = s.format.bytes, m = s.m;
  for (int64_t column = first_column; column < end_column; ++column) {
    __m512 acc[kInputs];
    __m128 offsets[kInputs];
    for (int r = 0; r < kInputs; ++r) {
      acc[r] = _mm512_setzero_ps();
      offsets[r] = _mm_setzero_ps();
    }
    const uint8_t* row = s.weight + column * s.row_bytes;
    for (int64_t super_block = 0; super_block < num_super_blocks; ++super_block) {
      const uint8_t* block = row + super_block * block_bytes;
      prefetch_ahead(block, block_bytes);
      __m256 scales, block_offsets;
      k_block_scales<kType>(block, &scales, &block_offsets);
      for (int half = 0; half < 2; ++half) {
        __m512i weight[4];
        __m512 d;
        __m128 mins;
        k_group_weights<kType>(block, half, scales, block_offsets, weight, &d, &mins);
        const int64_t group = 2 * super_block + half;
        for (int r = 0; r < kInputs; ++r) {
          const __m512 dot = _mm512_cvtepi32_ps(group_dot(weight, x_quants + (group * m + r) * 128));
          acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_loadu_ps(x_scales + (group * m + r) * 16)), acc[r]);
          if constexpr (kHasOffsets)
            offsets[r] = _mm_fmadd_ps(mins, _mm_loadu_ps(x_sums + (group * m + r) * 4), offsets[r]);
        }
      }
    }
    store_group_column<kInputs, kHasOffsets>(s, first_input, column, acc, offsets);
  }
}

#endif

#if defined(PAGEDSERVE_GGUF_AMX)
// The amx unit (Q8_0, Q4_0, Q4_1, and Q4_K per 32-value sub-block: decode_k_quant_tiles): per 32-value block, the
// block's integer dot products of up to 16 input rows with 16 weight rows in two tile products, C_high = x_high . w
// (TDPBSSD) and C_low = x_low . w (TDPBUSD, the low bytes unsigned), so sum(q_w q_x) = 256 C_high + C_low exactly, the
// same int32 the vector products sum; the epilogue converts it to float and adds dot * (d_w * d_x) (and Q4_1's m_w *
// s_x, Q4_K's -(dmin m_j) s_x) to one float32 accumulator per output, block after block in order. Exactness: |C_high|
// <= 32 * 128 * 128 and 256 C_high + C_low stays below 2^31; the float conversion rounds past 2^24 (Q8_0 only), as the
// vector products' lanes do. A row's result does not depend on the other rows or the thread count; it is not bitwise
// the vector products' (they convert and sum each block's four int32 lanes separately), so tests compare the units
// within float32 rounding.
//
// x is the A operand, laid out per call in tile order (State::x_tiles: a block's high and low bytes of a row in one
// 64-byte line); the weight is the B operand, decoded per call from its blocks into the VNNI layout (row r: for each
// of 16 columns, values 4r .. 4r + 3; transpose_runs): a unit of 16 columns decodes its K / 32 B tiles (512 bytes
// each) and its scales once, then runs every A tile of x against them. Both units run a row the same way whatever
// M is; 'auto' picks the unit by M, so a row's bits depend on the batch size through that choice.
namespace amx_unit {

// Tiles (the tile intrinsics take literal numbers): 0 x_high and 1 x_low (A), 2 and 7 the weight of an even and an
// odd block (B), 3 and 4 (even) and 5 and 6 (odd) their high and low sums.

inline void configure(int64_t tile_rows) {
  TileConfig config;
  std::memset(&config, 0, sizeof(config));
  config.palette_id = 1;
  const auto set = [&config](int tile, int64_t rows, int64_t bytes) {
    config.rows[tile] = static_cast<uint8_t>(rows);
    config.colsb[tile] = static_cast<uint16_t>(bytes);
  };
  set(0, tile_rows, kQuantBlock);
  set(1, tile_rows, kQuantBlock);
  set(2, kQuantBlock / 4, 64);
  set(7, kQuantBlock / 4, 64);
  for (int tile = 3; tile <= 6; ++tile) set(tile, tile_rows, 64);
  load_tile_config(config);
}

// The dwords d of 16 byte runs of 16 bytes (run c at runs + c * stride, runs past num_columns read as 0) as four
// vectors: rows[d] holds dword d of run 0, 1, ..., 15 in that order. Run i + 4L goes to 128-bit lane L of vector i,
// then a 4 x 4 dword transpose inside each lane puts dword d of runs 4L .. 4L + 3 into lane L of rows[d].
inline void transpose_runs(const uint8_t* runs, int64_t stride, int64_t num_columns, __m512i rows[4]) {
  const auto run = [&](int64_t c) {
    return _mm_maskz_loadu_epi8(c < num_columns ? __mmask16{0xFFFF} : __mmask16{0}, runs + c * stride);
  };
  __m512i v[4];
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm512_castsi128_si512(run(i));
    v[i] = _mm512_inserti32x4(v[i], run(i + 4), 1);
    v[i] = _mm512_inserti32x4(v[i], run(i + 8), 2);
    v[i] = _mm512_inserti32x4(v[i], run(i + 12), 3);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(v[0], v[1]), t1 = _mm512_unpackhi_epi32(v[0], v[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(v[2], v[3]), t3 = _mm512_unpackhi_epi32(v[2], v[3]);
  rows[0] = _mm512_unpacklo_epi64(t0, t2);
  rows[1] = _mm512_unpackhi_epi64(t0, t2);
  rows[2] = _mm512_unpacklo_epi64(t1, t3);
  rows[3] = _mm512_unpackhi_epi64(t1, t3);
}

// Four 64-byte rows of Q4 quant bytes (row r: bytes 4r .. 4r + 3 of 16 columns' blocks; byte i holds value i in its
// low nibble, 16 + i in its high one) as a B tile: its rows r (values 4r ..) and 4 + r (values 16 + 4r ..).
template <int64_t kType>
inline void store_nibble_tile(const __m512i rows[4], int8_t* tile) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int r = 0; r < 4; ++r) {
    __m512i low = _mm512_and_si512(rows[r], nibble);
    __m512i high = _mm512_and_si512(_mm512_srli_epi16(rows[r], 4), nibble);
    if constexpr (kType == kGgmlQ4_0) {
      low = _mm512_sub_epi8(low, _mm512_set1_epi8(8));  // Q4_0's values are q - 8
      high = _mm512_sub_epi8(high, _mm512_set1_epi8(8));
    }
    _mm512_store_si512(tile + 64 * r, low);
    _mm512_store_si512(tile + 64 * (4 + r), high);
  }
}

// Block `block` of an interleaved row group (`group`: its first row's bytes) as the B tile's quants (Q4) and its 16
// d_w (and Q4_1's m_w): the chunks are already the tile's rows, Q4 splits each in its two nibbles. A Q8_0 group's
// quants are its B tile as they lie (run_amx_columns loads them in place): only the scales are read here.
template <int64_t kType>
inline void decode_interleaved_tile(const uint8_t* group, int64_t block, int8_t* tile, float* d, float* m) {
  constexpr int64_t kQuantBytes = kInterleavedQuantBytes<kType>;
  const uint8_t* blocks = group + block * kInterleavedRows * kBlockBytes<kType>;
  _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blocks + kQuantBytes))));
  if constexpr (kType == kGgmlQ4_1)
    _mm512_storeu_ps(m, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blocks + kQuantBytes + 32))));
  if constexpr (kType != kGgmlQ8_0) {
    __m512i rows[4];
    for (int r = 0; r < 4; ++r) rows[r] = _mm512_loadu_si512(blocks + 64 * r);
    store_nibble_tile<kType>(rows, tile);
  }
}

// Block `block` of weight rows [column, column + num_columns) as a B tile (8 rows of 64 bytes: row r holds values
// 4r .. 4r + 3 of each of the 16 columns) and its 16 d_w (and Q4_1's m_w); columns past num_columns read as 0.
template <int64_t kType>
inline void decode_weight_tile(const GgufLinearCall::State& s, int64_t column, int64_t num_columns, int64_t block,
                               int8_t* tile, float* d, float* m) {
  constexpr int64_t kBytes = kBlockBytes<kType>;
  const __mmask16 valid = num_columns >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << num_columns) - 1);
  const __m512i offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(static_cast<int>(s.row_bytes)));
  const uint8_t* base = s.weight + column * s.row_bytes + block * kBytes;
  // d (and Q4_1's m) of the 16 columns: the float16 words at the block's start.
  const __m512i header = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, offsets, base, 1);
  _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(header)));
  if constexpr (kType == kGgmlQ4_1) _mm512_storeu_ps(m, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(header, 16))));
  __m512i rows[4];
  if constexpr (kType == kGgmlQ8_0) {
    for (int half = 0; half < 2; ++half) {  // values 0 .. 15, then 16 .. 31
      transpose_runs(base + 2 + 16 * half, s.row_bytes, num_columns, rows);
      for (int r = 0; r < 4; ++r) _mm512_store_si512(tile + 64 * (4 * half + r), rows[r]);
    }
  } else {
    transpose_runs(base + (kType == kGgmlQ4_1 ? 4 : 2), s.row_bytes, num_columns, rows);
    store_nibble_tile<kType>(rows, tile);
  }
}

// Super-block `super_block` of 16 Q4_K columns as the B tiles and scales of its eight 32-value sub-blocks (blocks
// 8 super_block .. + 7 of the unit): sub-block j's values are the low (j even) or high (j odd) nibbles of quant bytes
// 32 (j / 2) .. + 31, so each pair of sub-blocks takes two transposes of 16-byte runs, and its d_w / m_w per column
// are d sc_j and -(dmin m_j) (k_scales_and_offsets, 16 columns scattered into sub-block order).
inline void decode_k_quant_tiles(const GgufLinearCall::State& s, int64_t column, int64_t num_columns,
                                 int64_t super_block, int8_t* tiles, float* d, float* m) {
  const uint8_t* base = s.weight + column * s.row_bytes + super_block * 144;
  for (int64_t c = 0; c < 16; ++c) {
    alignas(32) float scales[8], offsets[8];
    __m256 scale_vector = _mm256_setzero_ps(), offset_vector = _mm256_setzero_ps();
    if (c < num_columns) k_scales_and_offsets(base + c * s.row_bytes, &scale_vector, &offset_vector);
    _mm256_store_ps(scales, scale_vector);
    _mm256_store_ps(offsets, offset_vector);
    for (int j = 0; j < 8; ++j) {
      d[16 * j + c] = scales[j];
      m[16 * j + c] = offsets[j];
    }
  }
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int pair = 0; pair < 4; ++pair) {
    __m512i first[4], second[4];  // values 0 .. 15 (tile rows 0 .. 3) and 16 .. 31 (rows 4 .. 7) of both sub-blocks
    transpose_runs(base + 16 + 32 * pair, s.row_bytes, num_columns, first);
    transpose_runs(base + 16 + 32 * pair + 16, s.row_bytes, num_columns, second);
    int8_t* low_tile = tiles + 512 * (2 * pair);  // sub-block 2 pair: the low nibbles
    int8_t* high_tile = tiles + 512 * (2 * pair + 1);
    for (int r = 0; r < 4; ++r) {
      _mm512_store_si512(low_tile + 64 * r, _mm512_and_si512(first[r], nibble));
      _mm512_store_si512(low_tile + 64 * (4 + r), _mm512_and_si512(second[r], nibble));
      _mm512_store_si512(high_tile + 64 * r, _mm512_and_si512(_mm512_srli_epi16(first[r], 4), nibble));
      _mm512_store_si512(high_tile + 64 * (4 + r), _mm512_and_si512(_mm512_srli_epi16(second[r], 4), nibble));
    }
  }
}

}  // namespace amx_unit

// One A tile of x (tile_rows rows from first_input; the epilogue scales the first kRows <= tile_rows of them, a
// compile-time count so the accumulators stay in registers) against a decoded 16-column unit: block by block, the two tile products into one
// of two pairs of C tiles (3, 4 for even blocks, 5, 6 for odd ones), then the epilogue, block after block in order;
// the next block's products are issued before this block's epilogue.
template <int64_t kType, int kRows>
inline void run_amx_tile(const GgufLinearCall::State& s, const int8_t* tiles, int64_t tile_stride, const float* d_w,
                         const float* m_w, int64_t first_input, __m512 (&acc)[kAmxTileRows]) {
  const int64_t num_blocks = s.k / kQuantBlock, k = s.k;
  alignas(64) int32_t sums[2][2][kAmxTileRows * 16];
  // This tile's rows, block after block: 64 bytes per row (high bytes, then low bytes).
  const uint8_t* x = s.x_tiles.data() + first_input * k * 2;
  constexpr int64_t kRowBytes = 2 * kQuantBlock;
  const int64_t block_bytes = s.tile_rows * kRowBytes;
  const float* x_scales = s.x_scales.data() + first_input * num_blocks;
  const float* x_sums = s.x_sums.data() + first_input * num_blocks;
  const auto epilogue = [&](int64_t block, const int32_t* high, const int32_t* low) {
    const __m512 d = _mm512_loadu_ps(d_w + block * 16);
    constexpr bool kHasOffsets = kType == kGgmlQ4_1 || kType == kGgmlQ4_K;  // m_w: Q4_1's m, Q4_K's -(dmin m_j)
    const __m512 m = kHasOffsets ? _mm512_loadu_ps(m_w + block * 16) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) {
      const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(high + 16 * r), 8),
                                           _mm512_load_si512(low + 16 * r));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(x_scales[r * num_blocks + block])),
                               acc[r]);
      if constexpr (kHasOffsets) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x_sums[r * num_blocks + block]), acc[r]);
    }
  };
  // A block's two tile products into C tiles `high` and `low`, its weight in B tile `b`. The tile numbers must be
  // literals (the intrinsics paste them into the instruction's text), hence a macro over the two pairs.
#define PAGEDSERVE_BLOCK_PRODUCTS(block, b, high, low)                          \
  do {                                                                          \
    _tile_loadd(0, x + (block) * block_bytes, kRowBytes);                       \
    _tile_loadd(1, x + (block) * block_bytes + kQuantBlock, kRowBytes);         \
    _tile_loadd(b, tiles + (block) * tile_stride, 64);                          \
    _tile_zero(high);                                                           \
    _tile_zero(low);                                                            \
    _tile_dpbssd(high, 0, b);                                                   \
    _tile_dpbusd(low, 1, b);                                                    \
  } while (false)
  const auto even_products = [&](int64_t block) { PAGEDSERVE_BLOCK_PRODUCTS(block, 2, 3, 4); };
  const auto odd_products = [&](int64_t block) { PAGEDSERVE_BLOCK_PRODUCTS(block, 7, 5, 6); };
#undef PAGEDSERVE_BLOCK_PRODUCTS
  even_products(0);
  for (int64_t block = 0; block < num_blocks; block += 2) {
    const bool has_odd = block + 1 < num_blocks;  // K's last block may be alone
    if (has_odd) odd_products(block + 1);
    _tile_stored(3, sums[0][0], 64);
    _tile_stored(4, sums[0][1], 64);
    if (block + 2 < num_blocks) even_products(block + 2);
    epilogue(block, sums[0][0], sums[0][1]);
    if (has_odd) {
      _tile_stored(5, sums[1][0], 64);
      _tile_stored(6, sums[1][1], 64);
      epilogue(block + 1, sums[1][0], sums[1][1]);
    }
  }
}

// run_amx_tile with kRows = `rows` (1 .. 16), chosen at run time.
template <int64_t kType, int kRows = 1>
inline void run_amx_tile_rows(const GgufLinearCall::State& s, const int8_t* tiles, int64_t tile_stride,
                              const float* d_w, const float* m_w, int64_t first_input, int64_t rows,
                              __m512 (&acc)[kAmxTileRows]) {
  if constexpr (kRows < kAmxTileRows) {
    if (rows != kRows)
      return run_amx_tile_rows<kType, kRows + 1>(s, tiles, tile_stride, d_w, m_w, first_input, rows, acc);
  }
  run_amx_tile<kType, kRows>(s, tiles, tile_stride, d_w, m_w, first_input, acc);
}

// kInterleaved: the weight in its interleaved layout (every unit 16 whole columns).
template <int64_t kType, bool kInterleaved>
void run_amx_columns(const GgufLinearCall::State& s, int64_t first_column, int64_t end_column) {
  const int64_t num_blocks = s.k / kQuantBlock;
  // This thread's decoded B tiles and scales of one 16-column unit (K / 32 x 512 bytes: 24 KiB at K = 1536).
  thread_local std::vector<int8_t> tiles_storage;
  thread_local std::vector<float> scales_storage;
  tiles_storage.resize(num_blocks * 512 + 64);
  scales_storage.resize(num_blocks * 32);
  int8_t* const tiles = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(tiles_storage.data()) + 63) & ~uintptr_t{63});
  float* const d_w = scales_storage.data();
  float* const m_w = d_w + num_blocks * 16;
  amx_unit::configure(s.tile_rows);
  for (int64_t column = first_column; column < end_column; column += kAmxColumns) {
    const int64_t num_columns = std::min<int64_t>(kAmxColumns, end_column - column);
    const int8_t* unit_tiles = tiles;
    int64_t tile_stride = 512;
    if constexpr (kInterleaved) {
      const uint8_t* group = s.weight + column * s.row_bytes;
      for (int64_t block = 0; block < num_blocks; ++block)
        amx_unit::decode_interleaved_tile<kType>(group, block, tiles + block * 512, d_w + block * 16, m_w + block * 16);
      if constexpr (kType == kGgmlQ8_0) {  // the quants are the B tiles
        unit_tiles = reinterpret_cast<const int8_t*>(group);
        tile_stride = kInterleavedRows * kBlockBytes<kType>;
      }
    } else if constexpr (kType == kGgmlQ4_K) {
      for (int64_t super_block = 0; super_block < num_blocks / 8; ++super_block)
        amx_unit::decode_k_quant_tiles(s, column, num_columns, super_block, tiles + super_block * 8 * 512,
                                       d_w + super_block * 8 * 16, m_w + super_block * 8 * 16);
    } else {
      for (int64_t block = 0; block < num_blocks; ++block)
        amx_unit::decode_weight_tile<kType>(s, column, num_columns, block, tiles + block * 512, d_w + block * 16,
                                            m_w + block * 16);
    }
    const __mmask16 valid = num_columns >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << num_columns) - 1);
    const __m512 bias = s.bias != nullptr ? _mm512_maskz_loadu_ps(valid, s.bias + column) : _mm512_setzero_ps();
    for (int64_t first_input = 0; first_input < s.m; first_input += s.tile_rows) {
      const int64_t num_inputs = std::min<int64_t>(s.tile_rows, s.m - first_input);
      __m512 acc[kAmxTileRows];
      for (int64_t r = 0; r < kAmxTileRows; ++r) acc[r] = _mm512_setzero_ps();
      // Every tile's products cover tile_rows rows (x's quants are padded to whole tiles once M > 16); the epilogue
      // scales only the rows that exist: x's scales and sums have M rows, none for the padding.
      run_amx_tile_rows<kType>(s, unit_tiles, tile_stride, d_w, m_w, first_input, num_inputs, acc);
      for (int64_t r = 0; r < num_inputs; ++r)
        _mm512_mask_storeu_ps(s.y + (first_input + r) * s.y_stride + column, valid, _mm512_add_ps(acc[r], bias));
    }
  }
  _tile_release();
}
#endif  // PAGEDSERVE_GGUF_AMX

// Every input row, up to kMaxGroupInputs at a time against each column range:
// `run(std::integral_constant<int, R>, input)` computes rows [input, input + R) with R's accumulators in registers.
template <class Run>
void in_groups(const GgufLinearCall::State& s, Run run) {
  int64_t input = 0;
  for (; input + kMaxGroupInputs <= s.m; input += kMaxGroupInputs)
    run(std::integral_constant<int, kMaxGroupInputs>{}, input);
  switch (s.m - input) {
#if defined(PAGEDSERVE_GGUF_AVX512)
    case 7: run(std::integral_constant<int, 7>{}, input); break;
    case 6: run(std::integral_constant<int, 6>{}, input); break;
    case 5: run(std::integral_constant<int, 5>{}, input); break;
    case 4: run(std::integral_constant<int, 4>{}, input); break;
#endif
    case 3: run(std::integral_constant<int, 3>{}, input); break;
    case 2: run(std::integral_constant<int, 2>{}, input); break;
    case 1: run(std::integral_constant<int, 1>{}, input); break;
    default: break;
  }
}

template <int64_t kType>
void run_all_integer_inputs(const GgufLinearCall::State& s, int64_t first_column, int64_t end_column) {
  in_groups(s, [&](auto inputs, int64_t input) {
#if defined(PAGEDSERVE_GGUF_AVX512)
    run_group_columns<kType, decltype(inputs)::value>(s, first_column, end_column, input);
#else
    run_integer_columns<kType, decltype(inputs)::value>(s, first_column, end_column, input);
#endif
  });
}

template <int64_t kType>
void run_all_k_quant_inputs(const GgufLinearCall::State& s, int64_t first_column, int64_t end_column) {
  in_groups(s, [&](auto inputs, int64_t input) {
#if defined(PAGEDSERVE_GGUF_AVX512)
    run_k_quant_group_columns<kType, decltype(inputs)::value>(s, first_column, end_column, input);
#else
    run_k_quant_columns<kType, decltype(inputs)::value>(s, first_column, end_column, input);
#endif
  });
}

// The interleaved layouts' vector products (Q8_0 / Q4_0 / Q4_1 in 16-row groups; gguf_interleave): per group of 16
// columns and 32-value block, the exact int32 sum(q_w q_x) of each column in one vector, as the amx unit's tile
// products make it: x's int16 quants in bytes (State::x_tiles), high bytes signed and low bytes unsigned, each
// product of 4 bytes a VPDPBUSD against a broadcast of 4 of x's bytes; the weight's chunks as unsigned bytes (Q4:
// the nibbles 0 .. 15; Q8_0: q + 128) against the high bytes and as signed bytes against the low ones; then
// 256 high + low - State::x_offsets. The epilogue is the amx unit's operation for operation (float(dot) * (d_w d_x)
// fused-added into the column's accumulator, then Q4_1's m_w s_x, per block in order; then + bias), so the two units
// give the same bits for a row whatever M is, and so does the scalar loop below on builds without VNNI.
constexpr int kMaxInterleavedInputs = 4;  // input rows per pass over a group (their accumulators in registers)

// Rows [first_input, first_input + kInputs) of x as the interleaved vector products read them: row r's block b in
// bytes at rows[r] + b * stride (64 bytes: 32 high bytes, then 32 low bytes), its scale, sum and integer remainder
// at [r * num_blocks + b] of scales, sums and offsets (offsets: null for Q4_1).
template <int kInputs>
struct InterleavedInputs {
  const uint8_t* rows[kInputs];
  int64_t stride;
  const float* scales;
  const float* sums;
  const int32_t* offsets;

  InterleavedInputs(const GgufLinearCall::State& s, int64_t first_input)
      : stride(s.tile_rows * 2 * kQuantBlock),
        scales(s.x_scales.data() + first_input * (s.k / kQuantBlock)),
        sums(s.x_sums.data() + first_input * (s.k / kQuantBlock)),
        offsets(s.x_offsets.empty() ? nullptr : s.x_offsets.data() + first_input * (s.k / kQuantBlock)) {
    const int64_t num_blocks = s.k / kQuantBlock;
    for (int r = 0; r < kInputs; ++r) {
      const int64_t input = first_input + r, tile = input / s.tile_rows, row = input % s.tile_rows;
      rows[r] = s.x_tiles.data() + (tile * num_blocks * s.tile_rows + row) * 2 * kQuantBlock;
    }
  }
};

// Four of x's bytes as one int32 (the broadcast operand of the byte products).
inline int32_t four_bytes(const uint8_t* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  return word;
}

// The same integers and the same float operations, a column and a row at a time: builds without AVX2.
template <int64_t kType, int kInputs>
void run_interleaved_columns_scalar(const GgufLinearCall::State& s, int64_t first_column, int64_t end_column,
                                    int64_t first_input) {
  constexpr int64_t kBytes = kBlockBytes<kType>;
  constexpr int64_t kQuantBytes = kInterleavedQuantBytes<kType>;
  const int64_t num_blocks = s.k / kQuantBlock;
  for (int64_t column = first_column; column < end_column; column += kInterleavedRows) {
    const uint8_t* const group = s.weight + column * s.row_bytes;
    for (int r = 0; r < kInputs; ++r) {
      const int64_t input = first_input + r;
      float acc[kInterleavedRows] = {};
      for (int64_t block = 0; block < num_blocks; ++block) {
        const uint8_t* const blocks = group + block * kInterleavedRows * kBytes;
        const int16_t* const x = s.x_quants.data() + input * s.k + block * kQuantBlock;
        const float x_scale = s.x_scales[input * num_blocks + block], x_sum = s.x_sums[input * num_blocks + block];
        for (int64_t c = 0; c < kInterleavedRows; ++c) {
          int32_t dot = 0;
          for (int i = 0; i < kQuantBlock; ++i) {
            int32_t q;
            if constexpr (kType == kGgmlQ8_0) {
              q = static_cast<int8_t>(blocks[64 * (i / 4) + 4 * c + i % 4]);
            } else {
              const uint8_t byte = blocks[64 * ((i % 16) / 4) + 4 * c + i % 4];
              q = i < 16 ? (byte & 0x0F) : (byte >> 4);
              if constexpr (kType == kGgmlQ4_0) q -= 8;
            }
            dot += q * x[i];
          }
          const float d = half_to_float(blocks + kQuantBytes + 2 * c);
          acc[c] = std::fma(static_cast<float>(dot), d * x_scale, acc[c]);
          if constexpr (kType == kGgmlQ4_1) acc[c] = std::fma(half_to_float(blocks + kQuantBytes + 32 + 2 * c), x_sum, acc[c]);
        }
      }
      for (int64_t c = 0; c < kInterleavedRows; ++c)
        s.y[input * s.y_stride + column + c] = acc[c] + (s.bias != nullptr ? s.bias[column + c] : 0.0f);
    }
  }
}

#if defined(PAGEDSERVE_GGUF_VNNI)
template <int64_t kType, int kInputs>
void run_interleaved_columns(const GgufLinearCall::State& s, int64_t first_column, int64_t end_column,
                             int64_t first_input) {
  constexpr int64_t kBytes = kBlockBytes<kType>;
  constexpr int64_t kQuantBytes = kInterleavedQuantBytes<kType>;
  const int64_t num_blocks = s.k / kQuantBlock;
  const InterleavedInputs<kInputs> in(s, first_input);
  const auto broadcast = [](const uint8_t* p) { return _mm512_set1_epi32(four_bytes(p)); };
  for (int64_t column = first_column; column < end_column; column += kInterleavedRows) {
    const uint8_t* const group = s.weight + column * s.row_bytes;
    __m512 acc[kInputs];
    for (int r = 0; r < kInputs; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t block = 0; block < num_blocks; ++block) {
      const uint8_t* const blocks = group + block * kInterleavedRows * kBytes;
      prefetch_ahead(blocks, kInterleavedRows * kBytes);
      // Chunk j pairs with x's bytes 4j .. 4j + 3 (Q4: the low nibbles of chunk j < 4 are values 4j .., the high
      // nibbles of chunk j - 4 values 16 + 4 (j - 4) ..).
      __m512i as_unsigned[8], as_signed[8];
      if constexpr (kType == kGgmlQ8_0) {
        for (int j = 0; j < 8; ++j) {
          as_signed[j] = _mm512_loadu_si512(blocks + 64 * j);
          as_unsigned[j] = _mm512_xor_si512(as_signed[j], _mm512_set1_epi8(static_cast<char>(0x80)));
        }
      } else {
        const __m512i nibble = _mm512_set1_epi8(0x0F);
        for (int j = 0; j < 4; ++j) {
          const __m512i chunk = _mm512_loadu_si512(blocks + 64 * j);
          as_unsigned[j] = as_signed[j] = _mm512_and_si512(chunk, nibble);
          as_unsigned[j + 4] = as_signed[j + 4] = _mm512_and_si512(_mm512_srli_epi16(chunk, 4), nibble);
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blocks + kQuantBytes)));
      const __m512 m = kType == kGgmlQ4_1
                           ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blocks + kQuantBytes + 32)))
                           : _mm512_setzero_ps();
      for (int r = 0; r < kInputs; ++r) {
        const uint8_t* const x = in.rows[r] + block * in.stride;
        // Two chains each for the high and low bytes (even and odd chunks): shorter dependency chains.
        __m512i high[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        __m512i low[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        for (int j = 0; j < 8; ++j) {
          high[j & 1] = _mm512_dpbusd_epi32(high[j & 1], as_unsigned[j], broadcast(x + 4 * j));
          low[j & 1] = _mm512_dpbusd_epi32(low[j & 1], broadcast(x + kQuantBlock + 4 * j), as_signed[j]);
        }
        __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(high[0], high[1]), 8),
                                       _mm512_add_epi32(low[0], low[1]));
        if constexpr (kType != kGgmlQ4_1) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(in.offsets[r * num_blocks + block]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(in.scales[r * num_blocks + block])),
                                 acc[r]);
        if constexpr (kType == kGgmlQ4_1) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(in.sums[r * num_blocks + block]), acc[r]);
      }
    }
    const __m512 bias = s.bias != nullptr ? _mm512_loadu_ps(s.bias + column) : _mm512_setzero_ps();
    for (int r = 0; r < kInputs; ++r)
      _mm512_storeu_ps(s.y + (first_input + r) * s.y_stride + column, _mm512_add_ps(acc[r], bias));
  }
}
#elif defined(PAGEDSERVE_GGUF_AVX2)
// AVX2 without VNNI, Q8_0: a group's 16 rows as two halves of 8, one half after the other over the group's blocks
// (the second pass reads them from L1). A chunk's 32 bytes of a half (4 quants of each of 8 rows) widened to int16,
// rows 0-3 and rows 4-7 of the half, and multiplied by x's int16 quants 4j .. 4j + 3 broadcast (VPMADDWD: each lane
// a row's pair of products, at most 2 x 128 x 32768 = 2^23; eight chunks' pairs sum to at most 2^26 in int32); per
// block a row's two lanes are summed (VPHADDD, then a fixed lane permutation back into row order): the exact
// sum(q_w q_x) of the other units, then the same epilogue per lane.
template <int kInputs>
void run_interleaved_q8_0_columns(const GgufLinearCall::State& s, int64_t first_column, int64_t end_column,
                                  int64_t first_input) {
  constexpr int64_t kBytes = kBlockBytes<kGgmlQ8_0>;
  constexpr int64_t kQuantBytes = kInterleavedQuantBytes<kGgmlQ8_0>;
  const int64_t num_blocks = s.k / kQuantBlock;
  const int16_t* x_rows[kInputs];
  const float* x_scales[kInputs];
  for (int r = 0; r < kInputs; ++r) {
    x_rows[r] = s.x_quants.data() + (first_input + r) * s.k;
    x_scales[r] = s.x_scales.data() + (first_input + r) * num_blocks;
  }
  // VPHADDD of rows 0-3 (a) and rows 4-7 (b) leaves the rows in lanes 0, 1, 4, 5, 2, 3, 6, 7.
  const __m256i row_order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  for (int64_t column = first_column; column < end_column; column += kInterleavedRows) {
    const uint8_t* const group = s.weight + column * s.row_bytes;
    for (int half = 0; half < 2; ++half) {  // rows 8 half .. 8 half + 7: bytes 32 half .. of each chunk
      __m256 acc[kInputs];
      for (int r = 0; r < kInputs; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t block = 0; block < num_blocks; ++block) {
        const uint8_t* const blocks = group + block * kInterleavedRows * kBytes;
        if (half == 0) prefetch_ahead(blocks, kInterleavedRows * kBytes);  // the second half's pass finds them cached
        __m256i first[kInputs], second[kInputs];  // rows 0-3 and 4-7 of the half: two lanes per row
        for (int r = 0; r < kInputs; ++r) first[r] = second[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
          const uint8_t* const chunk = blocks + 64 * j + 32 * half;
          const __m256i rows_low = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk)));
          const __m256i rows_high = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 16)));
          for (int r = 0; r < kInputs; ++r) {
            int64_t four;  // x's quants 4j .. 4j + 3 of this block
            std::memcpy(&four, x_rows[r] + block * kQuantBlock + 4 * j, sizeof(four));
            const __m256i x = _mm256_set1_epi64x(four);
            first[r] = _mm256_add_epi32(first[r], _mm256_madd_epi16(rows_low, x));
            second[r] = _mm256_add_epi32(second[r], _mm256_madd_epi16(rows_high, x));
          }
        }
        const __m256 d =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks + kQuantBytes + 16 * half)));
        for (int r = 0; r < kInputs; ++r) {
          const __m256i dot = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(first[r], second[r]), row_order);
          const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x_scales[r][block]));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r]);
        }
      }
      const __m256 bias = s.bias != nullptr ? _mm256_loadu_ps(s.bias + column + 8 * half) : _mm256_setzero_ps();
      for (int r = 0; r < kInputs; ++r)
        _mm256_storeu_ps(s.y + (first_input + r) * s.y_stride + column + 8 * half, _mm256_add_ps(acc[r], bias));
    }
  }
}

// AVX2 without VNNI, the Q4 types: a group's 16 rows as two halves of 8 in 256-bit vectors, VPMADDUBSW for the byte
// products (exact here: a pair of the high bytes' products is at most 2 x 15 x 128 = 3840 and eight chunks' pairs
// sum to 30720 in int16; a pair of the low bytes' at most 2 x 255 x 15 = 7650, four chunks at a time), VPMADDWD by
// ones into int32, then the same epilogue per lane.
template <int64_t kType, int kInputs>
void run_interleaved_columns(const GgufLinearCall::State& s, int64_t first_column, int64_t end_column,
                             int64_t first_input) {
  if constexpr (kType == kGgmlQ8_0) {
    run_interleaved_q8_0_columns<kInputs>(s, first_column, end_column, first_input);
  } else {
    constexpr int64_t kBytes = kBlockBytes<kType>;
    constexpr int64_t kQuantBytes = kInterleavedQuantBytes<kType>;
    const int64_t num_blocks = s.k / kQuantBlock;
    const InterleavedInputs<kInputs> in(s, first_input);
    const auto broadcast = [](const uint8_t* p) { return _mm256_set1_epi32(four_bytes(p)); };
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int64_t column = first_column; column < end_column; column += kInterleavedRows) {
      const uint8_t* const group = s.weight + column * s.row_bytes;
      __m256 acc[kInputs][2];
      for (int r = 0; r < kInputs; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
      for (int64_t block = 0; block < num_blocks; ++block) {
        const uint8_t* const blocks = group + block * kInterleavedRows * kBytes;
        prefetch_ahead(blocks, kInterleavedRows * kBytes);
        for (int half = 0; half < 2; ++half) {  // rows 8 half .. 8 half + 7: bytes 32 half .. of each chunk
          __m256i weight[8];  // chunk j < 4's low nibbles, then chunk j - 4's high ones (x's bytes 4j ..)
          for (int j = 0; j < 4; ++j) {
            const __m256i chunk = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blocks + 64 * j + 32 * half));
            weight[j] = _mm256_and_si256(chunk, nibble);
            weight[j + 4] = _mm256_and_si256(_mm256_srli_epi16(chunk, 4), nibble);
          }
          const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks + kQuantBytes + 16 * half)));
          const __m256 m = kType == kGgmlQ4_1
                               ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks + kQuantBytes + 32 + 16 * half)))
                               : _mm256_setzero_ps();
          for (int r = 0; r < kInputs; ++r) {
            const uint8_t* const x = in.rows[r] + block * in.stride;
            __m256i high = _mm256_setzero_si256(), low[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int j = 0; j < 8; ++j) {
              high = _mm256_add_epi16(high, _mm256_maddubs_epi16(weight[j], broadcast(x + 4 * j)));
              low[j / 4] = _mm256_add_epi16(low[j / 4], _mm256_maddubs_epi16(broadcast(x + kQuantBlock + 4 * j), weight[j]));
            }
            __m256i dot = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(high, ones), 8),
                                           _mm256_add_epi32(_mm256_madd_epi16(low[0], ones), _mm256_madd_epi16(low[1], ones)));
            if constexpr (kType != kGgmlQ4_1) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(in.offsets[r * num_blocks + block]));
            acc[r][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(in.scales[r * num_blocks + block])),
                                           acc[r][half]);
            if constexpr (kType == kGgmlQ4_1)
              acc[r][half] = _mm256_fmadd_ps(m, _mm256_set1_ps(in.sums[r * num_blocks + block]), acc[r][half]);
          }
        }
      }
      for (int half = 0; half < 2; ++half) {
        const __m256 bias = s.bias != nullptr ? _mm256_loadu_ps(s.bias + column + 8 * half) : _mm256_setzero_ps();
        for (int r = 0; r < kInputs; ++r)
          _mm256_storeu_ps(s.y + (first_input + r) * s.y_stride + column + 8 * half, _mm256_add_ps(acc[r][half], bias));
      }
    }
  }
}
#else
template <int64_t kType, int kInputs>
void run_interleaved_columns(const GgufLinearCall::State& s, int64_t first_column, int64_t end_column,
                             int64_t first_input) {
  run_interleaved_columns_scalar<kType, kInputs>(s, first_column, end_column, first_input);
}
#endif

template <int64_t kType>
void run_all_interleaved_inputs(const GgufLinearCall::State& s, int64_t first_column, int64_t end_column) {
  // Group after group, every pass of rows over it: the group's blocks stay in L1 / L2 for the passes after the first.
  for (int64_t column = first_column; column < end_column; column += kInterleavedRows) {
    const int64_t end = column + kInterleavedRows;
    int64_t input = 0;
    for (; input + kMaxInterleavedInputs <= s.m; input += kMaxInterleavedInputs)
      run_interleaved_columns<kType, kMaxInterleavedInputs>(s, column, end, input);
    switch (s.m - input) {
      case 3: run_interleaved_columns<kType, 3>(s, column, end, input); break;
      case 2: run_interleaved_columns<kType, 2>(s, column, end, input); break;
      case 1: run_interleaved_columns<kType, 1>(s, column, end, input); break;
      default: break;
    }
  }
}

}  // namespace

void GgufLinearCall::run_units(int64_t begin, int64_t end) const {
  const State& s = *state_;
#if defined(PAGEDSERVE_GGUF_AMX)
  if (s.is_amx) {
    const int64_t first_column = begin * kAmxColumns, end_column = std::min(s.n, end * kAmxColumns);
    if (first_column >= end_column) return;
    switch (s.format_type) {
      case kGgmlQ8_0: run_amx_columns<kGgmlQ8_0, false>(s, first_column, end_column); break;
      case kGgmlQ4_0: run_amx_columns<kGgmlQ4_0, false>(s, first_column, end_column); break;
      case kGgmlQ4_1: run_amx_columns<kGgmlQ4_1, false>(s, first_column, end_column); break;
      case kGgmlQ8_0x16: run_amx_columns<kGgmlQ8_0, true>(s, first_column, end_column); break;
      case kGgmlQ4_0x16: run_amx_columns<kGgmlQ4_0, true>(s, first_column, end_column); break;
      case kGgmlQ4_1x16: run_amx_columns<kGgmlQ4_1, true>(s, first_column, end_column); break;
      case kGgmlQ4_K: run_amx_columns<kGgmlQ4_K, false>(s, first_column, end_column); break;
      default: break;  // uses_amx_products took an integer-product type
    }
    return;
  }
#endif
  if (s.is_interleaved) {
    const int64_t first_column = begin * kAmxColumns, end_column = std::min(s.n, end * kAmxColumns);
    switch (s.block_type) {
      case kGgmlQ8_0: run_all_interleaved_inputs<kGgmlQ8_0>(s, first_column, end_column); break;
      case kGgmlQ4_0: run_all_interleaved_inputs<kGgmlQ4_0>(s, first_column, end_column); break;
      case kGgmlQ4_1: run_all_interleaved_inputs<kGgmlQ4_1>(s, first_column, end_column); break;
      default: break;
    }
    return;
  }
  const int64_t first_column = begin * kRows, end_column = std::min(s.n, end * kRows);
  if (first_column >= end_column) return;
  switch (s.format_type) {
    case kGgmlQ8_0: run_all_integer_inputs<kGgmlQ8_0>(s, first_column, end_column); break;
    case kGgmlQ4_0: run_all_integer_inputs<kGgmlQ4_0>(s, first_column, end_column); break;
    case kGgmlQ4_1: run_all_integer_inputs<kGgmlQ4_1>(s, first_column, end_column); break;
    case kGgmlQ5_0: run_all_integer_inputs<kGgmlQ5_0>(s, first_column, end_column); break;
    case kGgmlQ5_1: run_all_integer_inputs<kGgmlQ5_1>(s, first_column, end_column); break;
    case kGgmlQ4_K: run_all_k_quant_inputs<kGgmlQ4_K>(s, first_column, end_column); break;
    case kGgmlQ5_K: run_all_k_quant_inputs<kGgmlQ5_K>(s, first_column, end_column); break;
    case kGgmlQ6_K: run_all_k_quant_inputs<kGgmlQ6_K>(s, first_column, end_column); break;
    default: break;  // the constructor checked the type
  }
}

void gguf_decode_row(const uint8_t* table, int64_t row_bytes, int64_t row, int64_t ggml_type, int64_t k, float* out) {
  const GgmlBlockFormat format = ggml_block_format(ggml_type);
  const int64_t block_type = block_type_of(ggml_type);
  const BlockDecoder decode = block_decoder(block_type);
  if (is_interleaved_type(ggml_type)) {
    const uint8_t* group = table + row / kInterleavedRows * kInterleavedRows * row_bytes;
    uint8_t block_bytes[34];  // the largest interleaved type's block (Q8_0)
    for (int64_t block = 0; block < k / format.values; ++block) {
      interleaved_block(group, block, row % kInterleavedRows, block_type, block_bytes);
      decode(block_bytes, out + block * format.values);
    }
    return;
  }
  for (int64_t block = 0; block < k / format.values; ++block)
    decode(table + row * row_bytes + block * format.bytes, out + block * format.values);
}

at::Tensor gguf_rows(const at::Tensor& weight, int64_t ggml_type, int64_t k, const at::Tensor& row_ids) {
  const GgmlBlockFormat format = checked_format(weight, ggml_type, k, "gguf_rows");
  const at::Tensor ids = row_ids.to(at::kLong).contiguous().reshape({-1});
  const int64_t num_rows = weight.size(0), num_ids = ids.size(0);
  const int64_t* id_data = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_ids; ++i)
    TORCH_CHECK_INDEX(id_data[i] >= 0 && id_data[i] < num_rows, "gguf_rows: row id ", id_data[i],
                      " is outside the table's ", num_rows, " rows");
  at::Tensor out = at::empty({num_ids, k}, at::TensorOptions().dtype(at::kFloat));
  float* out_data = out.data_ptr<float>();
  const uint8_t* table = weight.data_ptr<uint8_t>();
  const int64_t row_bytes = weight.size(1);
  at::parallel_for(0, num_ids, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_bytes)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t i = begin; i < end; ++i)
                       gguf_decode_row(table, row_bytes, id_data[i], ggml_type, k, out_data + i * k);
                   });
  return out;
}

}  // namespace pagedserve_native

namespace {

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& weight, int64_t ggml_type,
                       const c10::optional<at::Tensor>& bias, c10::string_view products) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "gguf_linear: x [M, K] and weight [N, bytes per row] expected, got ",
              x.sizes(), " and ", weight.sizes());
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  const pagedserve_native::GgufLinearCall call(x, weight, ggml_type, bias, y, std::string(products));
  at::parallel_for(0, call.num_units(), call.grain(), [&](int64_t begin, int64_t end) { call.run_units(begin, end); });
  return y;
}

// The whole table as float32 [N, K]: the blocks of a prefill-sized product, which then runs as a GEMM.
at::Tensor gguf_dequantize(const at::Tensor& weight, int64_t ggml_type, int64_t k) {
  return pagedserve_native::gguf_rows(weight, ggml_type, k, at::arange(weight.size(0), at::kLong));
}

at::Tensor gguf_embedding(const at::Tensor& weight, int64_t ggml_type, int64_t k, const at::Tensor& ids) {
  at::Tensor rows = pagedserve_native::gguf_rows(weight, ggml_type, k, ids);
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  return rows.reshape(shape);
}

int64_t gguf_linear_max_rows() { return pagedserve_native::kMaxInputs; }

std::vector<std::string> gguf_linear_products() { return pagedserve_native::gguf_linear_products(); }

// Every build has the kernels (the AVX2 decoders where the level has AVX2, the reference decoders elsewhere).
bool is_gguf_linear_supported() { return true; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("gguf_linear(Tensor x, Tensor weight, int ggml_type, Tensor? bias, str products='auto') -> Tensor");
  m.def("gguf_dequantize(Tensor weight, int ggml_type, int k) -> Tensor");
  m.def("gguf_embedding(Tensor weight, int ggml_type, int k, Tensor ids) -> Tensor");
  m.def("gguf_interleave(Tensor weight, int ggml_type) -> Tensor");
  m.def("gguf_interleaved_is_fast(int ggml_type) -> bool", &pagedserve_native::gguf_interleaved_is_fast);
  // No tensor arguments to dispatch on: a catch-all kernel.
  m.def("gguf_linear_max_rows() -> int", &gguf_linear_max_rows);
  m.def("gguf_linear_products() -> str[]", &gguf_linear_products);
  m.def("is_gguf_linear_supported() -> bool", &is_gguf_linear_supported);
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_dequantize", &gguf_dequantize);
  m.impl("gguf_embedding", &gguf_embedding);
  m.impl("gguf_interleave", &pagedserve_native::gguf_interleave);
}
