// W8A8 int8 linear layers: y[M, N] = ((x_q[M, K] @ w_q[N, K]^T) * x_scale) * w_scale + bias, the activation
// quantized in the op's prologue (per token: scale = max|x_row| / 127, q = round_half_even(x / scale) in
// [-127, 127]; or with a static per-tensor scale into [-128, 127]) and the weight int8 with per-channel scales.
//
// Python side: layers/quantization/w8a8_int8.py (int8_matmul.py holds the plain-PyTorch forms this op equals).
//
// Numerics: the quantization is the PyTorch form's operation for operation (a float32 division, then rounding half
// to even), the accumulators are exact int32 sums, and the epilogue is float32 ((acc * x_scale) * w_scale) + bias,
// rounded once to the output dtype: bitwise the float32 reference `int8_matmul_exact(x_q, w).float() * x_scale *
// w_scale + bias` for every M, thread count and ISA level (this file is compiled with fp-contract off, so the
// epilogue is never fused into an FMA).
//
// Products, three units (int8_linear_products() lists this build's; 'auto' picks per call), all exact int32 sums,
// so every unit gives the same bits:
// - 'amx' (the amx level, Linux granting the tile state; M >= kAmxMinRows and K a multiple of 64): TDPBSSD, int8 x
//   int8 into 16 x 16 int32 tiles. The weight is the A operand, loaded straight from its row-major [N, K] layout
//   (16 output columns x 64 K values per tile, row stride K), and x the B operand, packed per call into the VNNI
//   layout (x_tiles: for 16 input rows, one 64-byte row per 4 K values), so C holds y^T blocks and the weight
//   needs no packing at load. 32 columns x 32 rows per block (4 C tiles).
// - 'avx512_vnni' (avx512_bf16 and above): VPDPBUSD multiplies u8 by s8, 64 products per instruction. The weight
//   vector is made unsigned by flipping its sign bit (u = w + 128) and x stays signed, so a dot product is
//   sum(u * x) - 128 * sum(x): the row sums of x are taken at quantization, nothing is precomputed per weight.
// - 'int16' (every build; AVX2 intrinsics at avx2 and avx512): the int8 values are widened to int16 and multiplied
//   in pairs (vpmaddwd: 16 products per instruction, summed in int32; exact for every int8 pair, -128 included).
// The register units keep a tile of kInputs x kColumns accumulators while K streams through; each weight vector is
// loaded once per tile and used for every input row of it. Decode (M = 1) reads the weight once: one byte per
// value, half of a bf16 weight's bytes.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-fast-math", "fp-contract=off")
#endif

#include "int8_linear.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "bfloat16_rounding.h"
#include "int8_avx512.h"

#if defined(__AVX2__)
#include <immintrin.h>
#define PAGEDSERVE_INT8_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PAGEDSERVE_INT8_VNNI 1
#endif
#if defined(PAGEDSERVE_AMX) && defined(__AMX_INT8__) && defined(PAGEDSERVE_INT8_VNNI)
#define PAGEDSERVE_INT8_AMX 1
#endif

namespace pagedserve_native {

namespace {

constexpr int64_t kColumnsPerUnit = 8;  // output columns per work unit of the register units (a multiple of every
                                        // tile's kColumns)
constexpr int64_t kAmxColumnsPerUnit = 32;  // AMX: two A tiles of 16 output columns
// 'auto' takes AMX from this many rows where it runs: even at one row (15 of the B tile's 16 rows zero) it beat
// the VNNI unit on Emerald Rapids (SmolLM2's shapes, one thread's CPU time: benchmarks/w8a8_linear.py --cpu-time).
constexpr int64_t kAmxMinRows = 1;
constexpr int64_t kTileRows = 16;       // rows of every AMX tile here; 64 bytes per row
constexpr int64_t kTileDepth = 64;      // K values per AMX step (and per VNNI vector)
constexpr int64_t kLanes = 16;          // int16 values per vector
constexpr float kDynamicMax = 127.0f;

constexpr const char* kAmxProducts = "amx";
constexpr const char* kVnniProducts = "avx512_vnni";
constexpr const char* kInt16Products = "int16";

enum class Products { kInt16, kVnni, kAmx };

}  // namespace

struct Int8LinearCall::State {
  int64_t m = 0, n = 0, k = 0;
  Products products = Products::kInt16;
  int64_t columns_per_unit = kColumnsPerUnit;
  std::vector<int16_t> x_quants;  // int16 unit: [M, K] the quantized activation, widened to int16
  // avx512_vnni and amx units: [M, x_stride] the quantized activation, zero past K (x_stride: K rounded up to 64,
  // so a vector load never leaves the row), and each row's sum of quants (VPDPBUSD's correction).
  std::vector<int8_t> x_bytes;
  int64_t x_stride = 0;
  std::vector<int32_t> x_sums;
  // amx unit: x in the B tiles' layout, [ceil(M / 16), K / 4, 16, 4]: block b's 4-value group g of input row
  // 16 * b + r at ((b * K / 4 + g) * 16 + r) * 4; rows past M are zero.
  std::vector<int8_t> x_tiles;
  std::vector<float> x_scales;    // [M] one scale per row (the static scale repeated)
  const int8_t* weight = nullptr;
  const float* weight_scale = nullptr;
  at::Tensor weight_scale_tensor, bias_tensor;  // contiguous float32 copies where needed
  const float* bias = nullptr;
  float* y_float = nullptr;
  c10::BFloat16* y_bfloat16 = nullptr;
};

namespace {

template <class T>
inline float to_float(T value) {
  return static_cast<float>(value);
}

// One row of x quantized as the PyTorch forms do: q = clamp(round_half_even(x / scale), low, 127).
inline const float* as_vector_input(const float* x) { return x; }
inline const uint16_t* as_vector_input(const c10::BFloat16* x) { return reinterpret_cast<const uint16_t*>(x); }

template <class T, class Quant>
void quantize_row(const T* x, int64_t k, float scale, float low, Quant* quants) {
  for (int64_t i = 0; i < k; ++i) {
    const float q = std::nearbyint(to_float(x[i]) / scale);
    quants[i] = static_cast<Quant>(std::min(std::max(q, low), kDynamicMax));
  }
}

// The byte units' row: quants at x_bytes (zero past K as allocated) with their sum `sum`, copied into the B tiles.
void finish_byte_row(Int8LinearCall::State& s, int64_t row, int32_t sum) {
  const int8_t* quants = s.x_bytes.data() + row * s.x_stride;
  s.x_sums[row] = sum;
  if (s.products != Products::kAmx) return;
  const int64_t groups = s.k / 4, block = row / kTileRows, lane = row % kTileRows;
  int8_t* tiles = s.x_tiles.data() + (block * groups * kTileRows + lane) * 4;
  for (int64_t group = 0; group < groups; ++group) std::memcpy(tiles + group * kTileRows * 4, quants + group * 4, 4);
}

int32_t sum_of(const int8_t* quants, int64_t k) {
  int32_t sum = 0;
  for (int64_t i = 0; i < k; ++i) sum += quants[i];
  return sum;
}

template <class T>
void quantize_row_into(Int8LinearCall::State& s, int64_t row, const T* values, float scale, float low) {
  if (s.products == Products::kInt16) {
    quantize_row(values, s.k, scale, low, s.x_quants.data() + row * s.k);
    return;
  }
  int8_t* quants = s.x_bytes.data() + row * s.x_stride;
#if defined(PAGEDSERVE_INT8_VNNI)
  // The byte units exist only in AVX-512 builds: the vector form, the same bits (int8_avx512.h).
  finish_byte_row(s, row, pagedserve_native::quantize_row_avx512(as_vector_input(values), s.k, scale, low, quants));
#else
  quantize_row(values, s.k, scale, low, quants);
  finish_byte_row(s, row, sum_of(quants, s.k));
#endif
}

template <class T>
float row_absmax(const T* x, int64_t k) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < k; ++i) absmax = std::max(absmax, std::fabs(to_float(x[i])));
  return absmax;
}

template <class T>
void quantize_rows(const at::Tensor& x, const at::Tensor& input_scale, Int8LinearCall::State& s) {
  const T* data = x.data_ptr<T>();
  const int64_t stride = x.stride(0);
  const bool is_static = input_scale.defined();
  const float static_scale = is_static ? input_scale.item<float>() : 0.0f;
  at::parallel_for(0, s.m, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, s.k)), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* values = data + row * stride;
      if (is_static) {
        s.x_scales[row] = static_scale;
        quantize_row_into(s, row, values, static_scale, -128.0f);
      } else {
        // scale = absmax / 127; an all-zero row keeps scale 0 and divides by 1 (its quants are 0).
#if defined(PAGEDSERVE_INT8_VNNI)
        const float absmax = s.products == Products::kInt16
                                 ? row_absmax(values, s.k)
                                 : pagedserve_native::row_absmax_avx512(as_vector_input(values), s.k);
#else
        const float absmax = row_absmax(values, s.k);
#endif
        const float scale = absmax / kDynamicMax;
        s.x_scales[row] = scale;
        quantize_row_into(s, row, values, scale == 0.0f ? 1.0f : scale, -kDynamicMax);
      }
    }
  });
}

void widen_quantized_rows(const at::Tensor& x_q, const at::Tensor& input_scale, Int8LinearCall::State& s) {
  const int8_t* data = x_q.data_ptr<int8_t>();
  const at::Tensor scales = input_scale.to(at::kFloat).contiguous().reshape({-1});
  TORCH_CHECK(scales.numel() == 1 || scales.numel() == s.m, "w8a8_linear: an int8 x needs its scales as input_scale, ",
              "one value or one per row (", s.m, "), got ", input_scale.sizes());
  const float* scale_data = scales.data_ptr<float>();
  for (int64_t row = 0; row < s.m; ++row) {
    s.x_scales[row] = scale_data[scales.numel() == 1 ? 0 : row];
    const int8_t* values = data + row * x_q.stride(0);
    if (s.products == Products::kInt16) {
      for (int64_t i = 0; i < s.k; ++i) s.x_quants[row * s.k + i] = values[i];
    } else {
      std::memcpy(s.x_bytes.data() + row * s.x_stride, values, s.k);
      finish_byte_row(s, row, sum_of(values, s.k));
    }
  }
}

#if defined(PAGEDSERVE_INT8_AVX2)
inline int32_t sum_lanes(__m256i v) {
  const __m128i quad = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i pair = _mm_add_epi32(quad, _mm_unpackhi_epi64(quad, quad));
  return _mm_cvtsi128_si32(_mm_add_epi32(pair, _mm_shuffle_epi32(pair, 1)));
}
#endif

inline void store(const Int8LinearCall::State& s, int64_t input, int64_t column, int32_t dot) {
  float value = (static_cast<float>(dot) * s.x_scales[input]) * s.weight_scale[column];
  if (s.bias != nullptr) value = value + s.bias[column];
  const int64_t index = input * s.n + column;
  if (s.y_float != nullptr) {
    s.y_float[index] = value;
  } else {
    s.y_bfloat16[index] = c10::BFloat16(value);
  }
}

// Every input row, four at a time then the rest: `run(std::integral_constant<int, R>, input)` computes rows
// [input, input + R) (the register units' accumulator tiles have R rows).
template <class Run>
void in_groups_of_four(int64_t m, Run run) {
  int64_t input = 0;
  for (; input + 4 <= m; input += 4) run(std::integral_constant<int, 4>{}, input);
  switch (m - input) {
    case 3: run(std::integral_constant<int, 3>{}, input); break;
    case 2: run(std::integral_constant<int, 2>{}, input); break;
    case 1: run(std::integral_constant<int, 1>{}, input); break;
    default: break;
  }
}

// Rows [input, input + kInputs) x columns [column, column + kColumns): exact int32 dot products over K.
template <int kInputs, int kColumns>
void run_tile(const Int8LinearCall::State& s, int64_t input, int64_t column) {
  const int64_t k = s.k;
  const int8_t* weight = s.weight + column * k;
  const int16_t* x = s.x_quants.data() + input * k;
  int32_t dots[kInputs][kColumns] = {};
  int64_t i = 0;
#if defined(PAGEDSERVE_INT8_AVX2)
  __m256i acc[kInputs][kColumns];
  for (int r = 0; r < kInputs; ++r)
    for (int c = 0; c < kColumns; ++c) acc[r][c] = _mm256_setzero_si256();
  for (; i + kLanes <= k; i += kLanes) {
    __m256i w[kColumns];
    for (int c = 0; c < kColumns; ++c)
      w[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(weight + c * k + i)));
    for (int r = 0; r < kInputs; ++r) {
      const __m256i xr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * k + i));
      for (int c = 0; c < kColumns; ++c) acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(w[c], xr));
    }
  }
  for (int r = 0; r < kInputs; ++r)
    for (int c = 0; c < kColumns; ++c) dots[r][c] = sum_lanes(acc[r][c]);
#endif
  for (; i < k; ++i)
    for (int r = 0; r < kInputs; ++r)
      for (int c = 0; c < kColumns; ++c) dots[r][c] += static_cast<int32_t>(weight[c * k + i]) * x[r * k + i];
  for (int r = 0; r < kInputs; ++r)
    for (int c = 0; c < kColumns; ++c) store(s, input + r, column + c, dots[r][c]);
}

// Columns [first, end) for rows [input, input + kInputs), kColumns at a time (then one at a time for the rest).
template <int kInputs>
void run_columns(const Int8LinearCall::State& s, int64_t input, int64_t first, int64_t end) {
  // Register budget (16 vectors): kInputs x kColumns accumulators + kColumns weights + one x vector.
  constexpr int kColumns = kInputs <= 2 ? 4 : 2;
  int64_t column = first;
  for (; column + kColumns <= end; column += kColumns) run_tile<kInputs, kColumns>(s, input, column);
  for (; column < end; ++column) run_tile<kInputs, 1>(s, input, column);
}

#if defined(PAGEDSERVE_INT8_VNNI)
// Rows [input, input + kInputs) x columns [column, column + kColumns) by VPDPBUSD: u = w XOR 0x80 = w + 128 (u8)
// against x (s8), then dot = sum(u * x) - 128 * sum(x), exact in int32 (wrapping sums, the result in range).
template <int kInputs, int kColumns>
void run_tile_vnni(const Int8LinearCall::State& s, int64_t input, int64_t column) {
  const int64_t k = s.k, x_stride = s.x_stride;
  const int8_t* weight = s.weight + column * k;
  const int8_t* x = s.x_bytes.data() + input * x_stride;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc[kInputs][kColumns];
  for (int r = 0; r < kInputs; ++r)
    for (int c = 0; c < kColumns; ++c) acc[r][c] = _mm512_setzero_si512();
  const auto step = [&](int64_t i, __mmask64 mask) {
    __m512i w[kColumns];
    // Lanes past K load 0 (u = 128) and meet x's zero padding: they add nothing.
    for (int c = 0; c < kColumns; ++c) w[c] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, weight + c * k + i), flip);
    for (int r = 0; r < kInputs; ++r) {
      const __m512i xr = _mm512_loadu_si512(x + r * x_stride + i);
      for (int c = 0; c < kColumns; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], w[c], xr);
    }
  };
  int64_t i = 0;
  for (; i + kTileDepth <= k; i += kTileDepth) step(i, ~__mmask64{0});
  if (i < k) step(i, (__mmask64{1} << (k - i)) - 1);
  for (int r = 0; r < kInputs; ++r) {
    const int32_t correction = 128 * s.x_sums[input + r];
    if constexpr (kColumns % 4 == 0) {
      for (int c = 0; c < kColumns; c += 4) {
        alignas(16) int32_t dots[4];
        _mm_store_si128(reinterpret_cast<__m128i*>(dots),
                        _mm_sub_epi32(pagedserve_native::sum_lanes_4(acc[r][c], acc[r][c + 1], acc[r][c + 2],
                                                                     acc[r][c + 3]),
                                      _mm_set1_epi32(correction)));
        for (int j = 0; j < 4; ++j) store(s, input + r, column + c + j, dots[j]);
      }
    } else {
      for (int c = 0; c < kColumns; ++c)
        store(s, input + r, column + c, _mm512_reduce_add_epi32(acc[r][c]) - correction);
    }
  }
}

template <int kInputs>
void run_columns_vnni(const Int8LinearCall::State& s, int64_t input, int64_t first, int64_t end) {
  // Register budget (32 vectors): kInputs x kColumns accumulators + kColumns weights + one x vector.
  constexpr int kColumns = kInputs == 1 ? 8 : 4;
  int64_t column = first;
  for (; column + kColumns <= end; column += kColumns) run_tile_vnni<kInputs, kColumns>(s, input, column);
  for (; column < end; ++column) run_tile_vnni<kInputs, 1>(s, input, column);
}

void run_rows_vnni(const Int8LinearCall::State& s, int64_t first, int64_t last) {
  in_groups_of_four(s.m, [&](auto inputs, int64_t input) {
    run_columns_vnni<decltype(inputs)::value>(s, input, first, last);
  });
}
#endif  // PAGEDSERVE_INT8_VNNI

#if defined(PAGEDSERVE_INT8_AMX)
// `sums` is C[16 output columns][16 input rows] (64-byte aligned): y's rows [first_input, first_input + num_inputs)
// x columns [column, column + 16), with store()'s epilogue (the same float32 operations in the same order, then
// c10::BFloat16's rounding) 16 columns at a time.
void store_transposed(const Int8LinearCall::State& s, const int32_t* sums, int64_t first_input, int64_t num_inputs,
                      int64_t column) {
  __m512i rows[kTileRows];
  for (int64_t n = 0; n < kTileRows; ++n) rows[n] = _mm512_load_si512(sums + n * kTileRows);
  pagedserve_native::transpose_16x16(rows);  // rows[input] lane n: column + n
  const __m512 weight_scale = _mm512_loadu_ps(s.weight_scale + column);
  const __m512 bias = s.bias != nullptr ? _mm512_loadu_ps(s.bias + column) : _mm512_setzero_ps();
  for (int64_t r = 0; r < num_inputs; ++r) {
    const int64_t input = first_input + r;
    __m512 value = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(rows[r]), _mm512_set1_ps(s.x_scales[input])),
                                 weight_scale);
    if (s.bias != nullptr) value = _mm512_add_ps(value, bias);
    const int64_t index = input * s.n + column;
    if (s.y_float != nullptr) {
      _mm512_storeu_ps(s.y_float + index, value);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(s.y_bfloat16 + index),
                          _mm512_cvtepi32_epi16(pagedserve_native::bfloat16_bits(value)));
    }
  }
}

// Tiles 0-3: C, 16 output columns x 16 input rows of int32 (C0: A0 B0, C1: A0 B1, C2: A1 B0, C3: A1 B1); 4-5: A,
// the weight's rows (16 columns x 64 K values); 6-7: B, x_tiles (16 groups of 4 K values x 16 input rows).
// Columns [column, column + 16 * kColumnBlocks) x input rows [16 * block, 16 * (block + kRowBlocks)).
template <int kColumnBlocks, int kRowBlocks>
void run_amx_block(const Int8LinearCall::State& s, int64_t column, int64_t block) {
  const int64_t k = s.k, groups = k / 4;
  const int8_t* weight = s.weight + column * k;
  const int8_t* x = s.x_tiles.data() + block * groups * kTileRows * 4;
  const int64_t x_block_bytes = groups * kTileRows * 4;
  _tile_zero(0);
  if (kRowBlocks > 1) _tile_zero(1);
  if (kColumnBlocks > 1) _tile_zero(2);
  if (kColumnBlocks > 1 && kRowBlocks > 1) _tile_zero(3);
  for (int64_t i = 0; i < k; i += kTileDepth) {
    _tile_loadd(4, weight + i, k);
    _tile_loadd(6, x + i * kTileRows, 64);
    _tile_dpbssd(0, 4, 6);
    if (kRowBlocks > 1) {
      _tile_loadd(7, x + x_block_bytes + i * kTileRows, 64);
      _tile_dpbssd(1, 4, 7);
    }
    if (kColumnBlocks > 1) {
      _tile_loadd(5, weight + kTileRows * k + i, k);
      _tile_dpbssd(2, 5, 6);
      if (kRowBlocks > 1) _tile_dpbssd(3, 5, 7);
    }
  }
  alignas(64) int32_t sums[4][kTileRows * kTileRows];
  _tile_stored(0, sums[0], 64);
  if (kRowBlocks > 1) _tile_stored(1, sums[1], 64);
  if (kColumnBlocks > 1) _tile_stored(2, sums[2], 64);
  if (kColumnBlocks > 1 && kRowBlocks > 1) _tile_stored(3, sums[3], 64);
  for (int rows = 0; rows < kRowBlocks; ++rows) {
    const int64_t first_input = (block + rows) * kTileRows;
    const int64_t num_inputs = std::min<int64_t>(kTileRows, s.m - first_input);
    for (int columns = 0; columns < kColumnBlocks; ++columns)
      store_transposed(s, sums[columns * 2 + rows], first_input, num_inputs, column + columns * kTileRows);
  }
}

// Columns [first, last) on the tiles, 32 then 16 at a time; fewer than 16 left go to the VNNI tiles.
void run_amx(const Int8LinearCall::State& s, int64_t first, int64_t last) {
  pagedserve_native::configure_tile_rows({16, 16, 16, 16, 16, 16, 16, 16});
  const int64_t num_blocks = (s.m + kTileRows - 1) / kTileRows;
  int64_t column = first;
  for (; column + kTileRows <= last; column += kAmxColumnsPerUnit) {
    const bool is_pair = column + 2 * kTileRows <= last;
    int64_t block = 0;
    for (; block + 2 <= num_blocks; block += 2) {
      if (is_pair) run_amx_block<2, 2>(s, column, block); else run_amx_block<1, 2>(s, column, block);
    }
    if (block < num_blocks) {
      if (is_pair) run_amx_block<2, 1>(s, column, block); else run_amx_block<1, 1>(s, column, block);
    }
    if (!is_pair) {
      column += kTileRows;
      break;
    }
  }
  _tile_release();
  if (column < last) run_rows_vnni(s, column, last);
}
#endif  // PAGEDSERVE_INT8_AMX

// The units this build and process can run, preferred first (fixed for the process: the build's and the AMX
// permission's, asked once; built once, since every call's choose_products reads it).
const std::vector<std::string>& int8_linear_products() {
  static const std::vector<std::string> units = [] {
    std::vector<std::string> available;
#if defined(PAGEDSERVE_INT8_AMX)
    if (pagedserve_native::is_amx_usable()) available.emplace_back(kAmxProducts);
#endif
#if defined(PAGEDSERVE_INT8_VNNI)
    available.emplace_back(kVnniProducts);
#endif
    available.emplace_back(kInt16Products);
    return available;
  }();
  return units;
}

// The unit for an [M, K] x: `products` if named (checked against what runs here), else 'auto''s choice: AMX from
// kAmxMinRows rows when K is a multiple of 64 (a tile step), else VNNI where built, else int16.
Products choose_products(c10::string_view products, int64_t m, int64_t k) {
  TORCH_CHECK(products == "auto" || products == kAmxProducts || products == kVnniProducts ||
                  products == kInt16Products,
              "w8a8_linear: products must be 'auto', 'amx', 'avx512_vnni' or 'int16', got '", products, "'");
  const std::vector<std::string>& units = int8_linear_products();
  const bool has_amx = std::find(units.begin(), units.end(), kAmxProducts) != units.end();
  const bool has_vnni = std::find(units.begin(), units.end(), kVnniProducts) != units.end();
  if (products == "auto") {
    if (has_amx && m >= kAmxMinRows && k % kTileDepth == 0) return Products::kAmx;
    return has_vnni ? Products::kVnni : Products::kInt16;
  }
  TORCH_CHECK(std::find(units.begin(), units.end(), std::string(products)) != units.end(), "w8a8_linear: products='",
              products, "' is not available in this build or process (int8_linear_products() lists what is)");
  if (products == kAmxProducts) {
    TORCH_CHECK(k % kTileDepth == 0, "w8a8_linear: products='amx' needs K a multiple of ", kTileDepth, ", got K=", k);
    return Products::kAmx;
  }
  return products == kVnniProducts ? Products::kVnni : Products::kInt16;
}

int64_t grain_units(int64_t k, int64_t m) {
  // At least ~32 K multiply-adds of work per task: smaller tasks cost more to hand out than they take to run.
  return std::max<int64_t>(1, (32 * 1024) / std::max<int64_t>(1, kColumnsPerUnit * k * m));
}

}  // namespace

Int8LinearCall::Int8LinearCall(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                               const at::Tensor& input_scale, const at::Tensor& bias, at::Tensor y,
                               c10::string_view products)
    : state_(std::make_unique<State>()) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "w8a8_linear: x must be [M, K] with unit column stride, got ",
              x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kChar,
              "w8a8_linear: x must be float32, bfloat16 or int8 (already quantized), got ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous(),
              "w8a8_linear: a contiguous int8 weight [N, K] expected, got ", weight.sizes(), " ", weight.scalar_type());
  State& s = *state_;
  s.m = x.size(0);
  s.k = x.size(1);
  s.n = weight.size(0);
  TORCH_CHECK(weight.size(1) == s.k, "w8a8_linear: x has K=", s.k, " values per row, the weight ", weight.size(1));
  TORCH_CHECK(weight_scale.numel() == s.n, "w8a8_linear: weight_scale holds ", weight_scale.numel(),
              " values, the weight has ", s.n, " rows");
  s.weight_scale_tensor = weight_scale.to(at::kFloat).contiguous();
  s.weight_scale = s.weight_scale_tensor.data_ptr<float>();
  s.weight = weight.data_ptr<int8_t>();
  if (bias.defined()) {
    TORCH_CHECK(bias.numel() == s.n, "w8a8_linear: bias holds ", bias.numel(), " values, expected ", s.n);
    s.bias_tensor = bias.to(at::kFloat).contiguous();
    s.bias = s.bias_tensor.data_ptr<float>();
  }
  TORCH_CHECK(y.is_contiguous() && y.dim() == 2 && y.size(0) == s.m && y.size(1) == s.n &&
                  (y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16),
              "w8a8_linear: the output must be a contiguous float32 or bfloat16 [", s.m, ", ", s.n, "] tensor");
  if (y.scalar_type() == at::kFloat) {
    s.y_float = y.data_ptr<float>();
  } else {
    s.y_bfloat16 = y.data_ptr<c10::BFloat16>();
  }
  s.products = choose_products(products, s.m, s.k);
  if (s.products == Products::kInt16) {
    s.x_quants.resize(s.m * s.k);
  } else {
    s.x_stride = (s.k + kTileDepth - 1) / kTileDepth * kTileDepth;
    s.x_bytes.assign(s.m * s.x_stride, 0);
    s.x_sums.resize(s.m);
  }
  if (s.products == Products::kAmx) {
    s.columns_per_unit = kAmxColumnsPerUnit;
    s.x_tiles.assign((s.m + kTileRows - 1) / kTileRows * kTileRows * s.k, 0);
  }
  s.x_scales.resize(s.m);
  if (x.scalar_type() == at::kChar) {
    TORCH_CHECK(input_scale.defined(), "w8a8_linear: an int8 x needs its scales as input_scale");
    widen_quantized_rows(x, input_scale, s);
    return;
  }
  if (input_scale.defined())
    TORCH_CHECK(input_scale.numel() == 1, "w8a8_linear: a static input_scale is one value, got ",
                input_scale.sizes());
  const at::Tensor static_scale = input_scale.defined() ? input_scale.to(at::kFloat) : at::Tensor();
  if (x.scalar_type() == at::kFloat) {
    quantize_rows<float>(x, static_scale, s);
  } else {
    quantize_rows<c10::BFloat16>(x, static_scale, s);
  }
}

Int8LinearCall::~Int8LinearCall() = default;

int64_t Int8LinearCall::num_units() const {
  const State& s = *state_;
  return s.m == 0 ? 0 : (s.n + s.columns_per_unit - 1) / s.columns_per_unit;
}

int64_t Int8LinearCall::grain() const {
  const State& s = *state_;
  return std::max<int64_t>(1, grain_units(s.k, s.m) * kColumnsPerUnit / s.columns_per_unit);
}

void Int8LinearCall::run_units(int64_t begin, int64_t end) const {
  const State& s = *state_;
  const int64_t first = begin * s.columns_per_unit, last = std::min(s.n, end * s.columns_per_unit);
  if (first >= last) return;
#if defined(PAGEDSERVE_INT8_AMX)
  if (s.products == Products::kAmx) {
    run_amx(s, first, last);
    return;
  }
#endif
#if defined(PAGEDSERVE_INT8_VNNI)
  if (s.products == Products::kVnni) {
    run_rows_vnni(s, first, last);
    return;
  }
#endif
  // Input rows four at a time against the units' columns: the columns' weights stay in L1/L2 across the groups.
  in_groups_of_four(s.m, [&](auto inputs, int64_t input) {
    run_columns<decltype(inputs)::value>(s, input, first, last);
  });
}

}  // namespace pagedserve_native

namespace {

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                       const c10::optional<at::Tensor>& input_scale, const c10::optional<at::Tensor>& bias,
                       c10::optional<at::ScalarType> out_dtype, c10::string_view products) {
  const at::ScalarType dtype = out_dtype.value_or(x.scalar_type());
  TORCH_CHECK(x.dim() == 2, "w8a8_linear: x [M, K] expected, got ", x.sizes());
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options().dtype(dtype));
  const pagedserve_native::Int8LinearCall call(x, weight, weight_scale, input_scale.value_or(at::Tensor()),
                                               bias.value_or(at::Tensor()), y, products);
  at::parallel_for(0, call.num_units(), call.grain(), [&](int64_t begin, int64_t end) { call.run_units(begin, end); });
  return y;
}

// Every build has the kernel (the int16 unit at least: AVX2 products where the level has AVX2, the scalar loop
// elsewhere).
bool is_w8a8_linear_supported() { return true; }

std::vector<std::string> w8a8_linear_products() { return pagedserve_native::int8_linear_products(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("w8a8_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? input_scale, Tensor? bias, "
        "ScalarType? out_dtype=None, str products=\"auto\") -> Tensor");
  m.def("is_w8a8_linear_supported() -> bool", &is_w8a8_linear_supported);
  m.def("w8a8_linear_products() -> str[]", &w8a8_linear_products);
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) { m.impl("w8a8_linear", &w8a8_linear); }
