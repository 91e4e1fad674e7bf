// Fused elementwise CPU kernels of the decoder layers: RMSNorm, residual add + RMSNorm, neox rotary
// embedding and SiLU-and-mul, as torch ops in namespace `pagedserve` (Python side: kernels/elementwise.py).
//
// Ops (inputs are never written; every output is a new contiguous tensor in the input's dtype):
//   cpu_rms_norm(x [..., hidden], weight [hidden], eps, reduction_lanes) -> out
//   cpu_add_rms_norm(x, residual, weight, eps, reduction_lanes) -> (norm(x + residual), x + residual)
//   cpu_rotary_embedding(positions [tokens], query, key, cos_sin_cache [max_positions, head_dim], head_dim)
//       -> (rotated query, rotated key), neox layout (first half / second half of each head)
//   cpu_silu_and_mul(x [..., 2 * d]) -> silu(x[..., :d]) * x[..., d:]
// x, residual, query and key may be 1-, 2- or 3-D views with any strides except a contiguous last dimension
// (e.g. the query/key slices of a fused qkv output, or Qwen3's [tokens, heads, head_dim] view of them).
//
// Numerics: each kernel reproduces, rounding point for rounding point, the plain-PyTorch op sequence it
// replaces (forward_native in layers/norm.py, rotary.py, activation.py), so for float32 and bfloat16 the results
// are bitwise equal to it:
// - RMSNorm: squares are summed in float32 in the order ATen's `sum` over a contiguous last dimension uses
//   (SumKernel's cascade_sum: `reduction_lanes`-wide vectors in 4 interleaved accumulators with a cascade every
//   16 groups, then the scalar tail, then the lanes in order; 4 interleaved scalars below one vector; x86 runs
//   its 8-lane AVX2 build even on AVX-512 CPUs, where ATen registers no AVX-512 sum), mean = sum / n,
//   rstd = 1 / sqrt(mean + eps), x * rstd rounded to the input dtype, then times the weight (rounded). With a
//   residual, x + residual is rounded to the dtype first and is the returned residual.
// - RoPE: cos/sin rounded to the input dtype, then x * cos and rotate_half(x) * sin each rounded, then their
//   sum rounded (bfloat16 rounds three times, as the unfused bf16 ops do; float32 keeps every product
//   separate: no FMA).
// - SiLU-and-mul: silu(g) = g / (1 + exp(-g)) in float32 with ATen's vectorised exp (Sleef_expf16_u10, which
//   libtorch_cpu exports), rounded to the dtype, then times up (rounded). Every element takes this vector
//   formula; ATen finishes a row whose length is not a multiple of its vector with scalar std::exp, which can
//   differ in the last bit there (the batch-invariant mode forces ATen onto the vector formula too). In
//   bfloat16 the rounded silu of each of the 2^16 gate values is computed once by that formula and then
//   gathered from a table (bitwise the same, ~40% less time).
// Floating-point contraction is off in this file (below): GCC would otherwise fuse a multiply and an add,
// intrinsics included, into one FMA and move a rounding point.
//
// Batch invariance and threads: every token (row) is computed by one thread, alone, in a fixed order that
// depends only on the row length; rows are split between torch's intra-op threads (at::parallel_for). A
// token's result is therefore bitwise the same whatever the batch and the thread count.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

#include "bfloat16_rounding.h"
#include "bfloat16_silu_table.h"
#include "elementwise.h"
#include "exp_polynomial.h"
#include "vector_avx2.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGEDSERVE_ELEMENTWISE_AVX512 1
// ATen's vectorised float exp on AVX-512 (exported by libtorch_cpu). Weak: a torch build without it leaves
// the pointer null and exp16 below uses its own polynomial (close, not bitwise equal to ATen's silu).
extern "C" __m512 Sleef_expf16_u10(__m512) __attribute__((weak));
#endif

namespace {

// Rows per parallel task: at least this many elements each, so a small batch runs inline (one token of a
// decode step costs far less than waking the thread pool).
constexpr int64_t kGrainElements = 16384;

inline int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

// ---------------------------------------------------------------- storage types

template <typename scalar_t>
struct Storage;

template <>
struct Storage<float> {
  static float load(const float* pointer) { return *pointer; }
  static void store(float* pointer, float value) { *pointer = value; }
  static float round(float value) { return value; }
};

template <>
struct Storage<c10::BFloat16> {
  static float load(const c10::BFloat16* pointer) { return static_cast<float>(*pointer); }
  static void store(c10::BFloat16* pointer, float value) { *pointer = c10::BFloat16(value); }
  // To the nearest bfloat16 (ties to even), as a float: what a bf16 op result holds.
  static float round(float value) { return static_cast<float>(c10::BFloat16(value)); }
};

#if defined(PAGEDSERVE_ELEMENTWISE_AVX512)
constexpr int64_t kLanes = 16;

inline __mmask16 lanes_mask(int64_t count) {
  return count >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
}

inline __m512 load_vector(const float* pointer, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, pointer); }

inline __m512 load_vector(const c10::BFloat16* pointer, __mmask16 mask) {
  // bf16 is the upper half of a float: widen to 32 bits and shift into place (exact).
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, pointer);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

using pagedserve_native::bfloat16_bits;  // c10::BFloat16's rounding, lane by lane

template <typename scalar_t>
inline __m512 round_vector(__m512 v);

template <>
inline __m512 round_vector<float>(__m512 v) { return v; }

template <>
inline __m512 round_vector<c10::BFloat16>(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bfloat16_bits(v), 16));
}

inline void store_vector(float* pointer, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(pointer, mask, v); }

inline void store_vector(c10::BFloat16* pointer, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(pointer, mask, _mm512_cvtepi32_epi16(bfloat16_bits(v)));
}

// exp(x) for silu: Sleef's (ATen's own) when libtorch exports it, else Cephes' polynomial (exp_polynomial.h).
inline __m512 exp16(__m512 x) {
  if (Sleef_expf16_u10 != nullptr) return Sleef_expf16_u10(x);
  return pagedserve_native::cephes_exp16(x, -103.97f, 88.8f);
}
#endif

#if defined(PAGEDSERVE_AVX2)
// The AVX2 level's loads and stores of `count` (<= 8) elements of either dtype (vector_avx2.h), rounding as the
// dtype does.
inline const uint16_t* raw_bits(const c10::BFloat16* pointer) { return reinterpret_cast<const uint16_t*>(pointer); }
inline uint16_t* raw_bits(c10::BFloat16* pointer) { return reinterpret_cast<uint16_t*>(pointer); }
inline const float* raw_bits(const float* pointer) { return pointer; }
inline float* raw_bits(float* pointer) { return pointer; }

template <typename scalar_t>
inline __m256 load_lanes8(const scalar_t* pointer, int64_t count) {
  return count >= 8 ? pagedserve_native::load8(raw_bits(pointer))
                    : pagedserve_native::load8_partial(raw_bits(pointer), count);
}

template <typename scalar_t>
inline void store_lanes8(scalar_t* pointer, __m256 v, int64_t count) {
  if (count >= 8)
    pagedserve_native::store8(raw_bits(pointer), v);
  else
    pagedserve_native::store8_partial(raw_bits(pointer), v, count);
}

template <typename scalar_t>
inline __m256 round_lanes8(__m256 v) {
  if constexpr (std::is_same_v<scalar_t, float>)
    return v;
  else
    return pagedserve_native::round_to_bfloat16(v);
}
#endif

// ---------------------------------------------------------------- ATen's summation order

inline int64_t ceil_log2(int64_t value) {
  if (value <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t rest = static_cast<uint64_t>(value - 1); rest != 0; rest >>= 1) ++bits;
  return bits;
}

// `lanes` floats summed lane by lane (one "vector" of the portable path).
template <int lanes>
struct LaneSums {
  std::array<float, lanes> value{};
};

template <int lanes>
inline LaneSums<lanes> operator+(const LaneSums<lanes>& a, const LaneSums<lanes>& b) {
  LaneSums<lanes> sum;
  for (int lane = 0; lane < lanes; ++lane) sum.value[lane] = a.value[lane] + b.value[lane];
  return sum;
}

// The sum of items 0..count-1 (`item_at(i)`) in the order of ATen's row_sum / multi_row_sum (SumKernel.cpp):
// four interleaved accumulators (item i goes to i % 4) over whole groups of four; every 16 groups the level-0
// partials move up a cascade of four levels (16, 256, 4096 groups), which bounds the error growth; then the
// levels are folded, the items after the last whole group join accumulator 0, and the four are added in order.
template <typename Item, typename ItemAt>
inline Item ordered_sum(int64_t count, const ItemAt& item_at, Item zero) {
  constexpr int64_t kInterleave = 4;
  constexpr int64_t kLevels = 4;
  const int64_t num_groups = count / kInterleave;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(num_groups) / kLevels);
  const int64_t level_step = int64_t{1} << level_power;
  const int64_t level_mask = level_step - 1;
  Item acc[kLevels][kInterleave];
  for (auto& level : acc)
    for (auto& partial : level) partial = zero;
  int64_t group = 0;
  while (group + level_step <= num_groups) {
    for (int64_t step = 0; step < level_step; ++step, ++group)
      for (int64_t k = 0; k < kInterleave; ++k) acc[0][k] = acc[0][k] + item_at(group * kInterleave + k);
    for (int64_t level = 1; level < kLevels; ++level) {
      for (int64_t k = 0; k < kInterleave; ++k) {
        acc[level][k] = acc[level][k] + acc[level - 1][k];
        acc[level - 1][k] = zero;
      }
      if ((group & (level_mask << (level * level_power))) != 0) break;
    }
  }
  for (; group < num_groups; ++group)
    for (int64_t k = 0; k < kInterleave; ++k) acc[0][k] = acc[0][k] + item_at(group * kInterleave + k);
  for (int64_t level = 1; level < kLevels; ++level)
    for (int64_t k = 0; k < kInterleave; ++k) acc[0][k] = acc[0][k] + acc[level][k];
  for (int64_t i = num_groups * kInterleave; i < count; ++i) acc[0][0] = acc[0][0] + item_at(i);
  for (int64_t k = 1; k < kInterleave; ++k) acc[0][0] = acc[0][0] + acc[0][k];
  return acc[0][0];
}

// sum(x * x) over one row of `size` elements in ATen's order for a `lanes`-wide Vectorized<float> (portable).
template <int lanes, typename scalar_t>
float sum_of_squares_portable(const scalar_t* row, int64_t size) {
  auto square = [&](int64_t i) {
    const float value = Storage<scalar_t>::load(row + i);
    return value * value;
  };
  if (size < lanes) return ordered_sum<float>(size, square, 0.f);
  const int64_t num_vectors = size / lanes;
  const LaneSums<lanes> vector_sum = ordered_sum<LaneSums<lanes>>(
      num_vectors,
      [&](int64_t v) {
        LaneSums<lanes> item;
        for (int lane = 0; lane < lanes; ++lane) item.value[lane] = square(v * lanes + lane);
        return item;
      },
      LaneSums<lanes>{});
  float total = 0.f;
  for (int64_t i = num_vectors * lanes; i < size; ++i) total += square(i);
  for (int lane = 0; lane < lanes; ++lane) total += vector_sum.value[lane];
  return total;
}

#if defined(__AVX2__)
// 8 floats from 8 elements (bf16 widened exactly).
inline __m256 load_eight(const float* pointer) { return _mm256_loadu_ps(pointer); }

inline __m256 load_eight(const c10::BFloat16* pointer) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(pointer));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#endif

template <typename scalar_t>
float sum_of_squares(const scalar_t* row, int64_t size, int64_t reduction_lanes) {
#if defined(__AVX2__)
  // The x86 case (ATen's sum has no AVX-512 build: AVX-512 CPUs run its AVX2 kernel, 8 float lanes).
  if (reduction_lanes == 8 && size >= 8) {
    const int64_t num_vectors = size / 8;
    const __m256 vector_sum = ordered_sum<__m256>(
        num_vectors,
        [&](int64_t v) {
          const __m256 value = load_eight(row + v * 8);
          return _mm256_mul_ps(value, value);
        },
        _mm256_setzero_ps());
    float total = 0.f;
    for (int64_t i = num_vectors * 8; i < size; ++i) {
      const float value = Storage<scalar_t>::load(row + i);
      total += value * value;
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vector_sum);
    for (int64_t lane = 0; lane < 8; ++lane) total += lanes[lane];
    return total;
  }
#endif
  switch (reduction_lanes) {
    case 4: return sum_of_squares_portable<4>(row, size);
    case 8: return sum_of_squares_portable<8>(row, size);
    case 16: return sum_of_squares_portable<16>(row, size);
    default: TORCH_CHECK(false, "cpu_rms_norm: reduction_lanes must be 4, 8 or 16, got ", reduction_lanes);
  }
  return 0.f;
}

// ---------------------------------------------------------------- RMSNorm

// out = weight * round(source * rstd), rstd = 1 / sqrt(sum(source^2) / size + eps); `out` is contiguous.
template <typename scalar_t>
void normalize_row(const scalar_t* source, const scalar_t* weight, scalar_t* out, int64_t size, float eps,
                   int64_t reduction_lanes) {
  const float variance = sum_of_squares(source, size, reduction_lanes) / static_cast<float>(size);
  const float rstd = 1.0f / std::sqrt(variance + eps);
#if defined(PAGEDSERVE_ELEMENTWISE_AVX512)
  const __m512 rstd_vector = _mm512_set1_ps(rstd);
  for (int64_t i = 0; i < size; i += kLanes) {
    const __mmask16 mask = lanes_mask(size - i);
    const __m512 normalized = round_vector<scalar_t>(_mm512_mul_ps(load_vector(source + i, mask), rstd_vector));
    store_vector(out + i, _mm512_mul_ps(load_vector(weight + i, mask), normalized), mask);
  }
#elif defined(PAGEDSERVE_AVX2)
  const __m256 rstd_vector = _mm256_set1_ps(rstd);
  for (int64_t i = 0; i < size; i += 8) {
    const int64_t count = std::min<int64_t>(8, size - i);
    const __m256 normalized = round_lanes8<scalar_t>(_mm256_mul_ps(load_lanes8(source + i, count), rstd_vector));
    store_lanes8(out + i, _mm256_mul_ps(load_lanes8(weight + i, count), normalized), count);
  }
#else
  for (int64_t i = 0; i < size; ++i) {
    const float normalized = Storage<scalar_t>::round(Storage<scalar_t>::load(source + i) * rstd);
    Storage<scalar_t>::store(out + i, Storage<scalar_t>::load(weight + i) * normalized);
  }
#endif
}

// summed = round(x + residual), written to `summed` (contiguous).
template <typename scalar_t>
void add_row(const scalar_t* x, const scalar_t* residual, scalar_t* summed, int64_t size) {
#if defined(PAGEDSERVE_ELEMENTWISE_AVX512)
  for (int64_t i = 0; i < size; i += kLanes) {
    const __mmask16 mask = lanes_mask(size - i);
    store_vector(summed + i, _mm512_add_ps(load_vector(x + i, mask), load_vector(residual + i, mask)), mask);
  }
#elif defined(PAGEDSERVE_AVX2)
  for (int64_t i = 0; i < size; i += 8) {
    const int64_t count = std::min<int64_t>(8, size - i);
    store_lanes8(summed + i, _mm256_add_ps(load_lanes8(x + i, count), load_lanes8(residual + i, count)), count);
  }
#else
  for (int64_t i = 0; i < size; ++i)
    Storage<scalar_t>::store(summed + i, Storage<scalar_t>::load(x + i) + Storage<scalar_t>::load(residual + i));
#endif
}

// A 1-, 2- or 3-D tensor with a contiguous last dimension, seen as rows [outer][inner] of `size` elements.
struct RowLayout {
  int64_t outer = 1;
  int64_t inner = 1;
  int64_t outer_stride = 0;
  int64_t inner_stride = 0;
  int64_t size = 0;

  int64_t rows() const { return outer * inner; }
  int64_t offset(int64_t row) const { return (row / inner) * outer_stride + (row % inner) * inner_stride; }
};

RowLayout row_layout(const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(x.dim() >= 1 && x.dim() <= 3, op, ": ", name, " must be 1-, 2- or 3-D, got ", x.dim(), "-D");
  TORCH_CHECK(x.size(-1) <= 1 || x.stride(-1) == 1, op, ": ", name, "'s last dimension must be contiguous");
  RowLayout layout;
  layout.size = x.size(-1);
  if (x.dim() >= 2) {
    layout.outer = x.size(0);
    layout.outer_stride = x.stride(0);
  }
  if (x.dim() == 3) {
    layout.inner = x.size(1);
    layout.inner_stride = x.stride(1);
  }
  return layout;
}

// Calls function(scalar_t{}) for the tensor's dtype (float32 or bfloat16: the only dtypes the ops accept).
template <typename Function>
void dispatch_float_or_bfloat16(at::ScalarType type, const Function& function) {
  if (type == at::kFloat)
    function(float{});
  else
    function(c10::BFloat16{});
}

void check_floating(const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), op, ": ", name, " must be a CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": ", name,
              " must be float32 or bfloat16, got ", x.scalar_type());
}

void check_weight(const at::Tensor& weight, const at::Tensor& x, const char* op) {
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op, ": weight dtype ", weight.scalar_type(),
              " differs from the input's ", x.scalar_type());
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous(),
              op, ": weight must be a contiguous [", x.size(-1), "] CPU vector");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t reduction_lanes) {
  constexpr const char* op = "cpu_rms_norm";
  check_floating(x, op, "x");
  check_weight(weight, x, op);
  const RowLayout layout = row_layout(x, op, "x");
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (layout.size == 0 || layout.rows() == 0) return out;
  dispatch_float_or_bfloat16(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* source = x.const_data_ptr<scalar_t>();
    const scalar_t* weights = weight.const_data_ptr<scalar_t>();
    scalar_t* destination = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, layout.rows(), grain_rows(layout.size), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row)
        normalize_row(source + layout.offset(row), weights, destination + row * layout.size, layout.size,
                      static_cast<float>(eps), reduction_lanes);
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps, int64_t reduction_lanes) {
  constexpr const char* op = "cpu_add_rms_norm";
  check_floating(x, op, "x");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type() && residual.sizes() == x.sizes() && residual.device().is_cpu(),
              op, ": residual must match x in shape and dtype");
  check_weight(weight, x, op);
  const RowLayout x_layout = row_layout(x, op, "x");
  const RowLayout residual_layout = row_layout(residual, op, "residual");
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor summed = at::empty(x.sizes(), x.options());
  if (x_layout.size == 0 || x_layout.rows() == 0) return {out, summed};
  dispatch_float_or_bfloat16(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* x_data = x.const_data_ptr<scalar_t>();
    const scalar_t* residual_data = residual.const_data_ptr<scalar_t>();
    const scalar_t* weights = weight.const_data_ptr<scalar_t>();
    scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
    scalar_t* summed_data = summed.mutable_data_ptr<scalar_t>();
    const int64_t size = x_layout.size;
    at::parallel_for(0, x_layout.rows(), grain_rows(size), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        scalar_t* summed_row = summed_data + row * size;
        add_row(x_data + x_layout.offset(row), residual_data + residual_layout.offset(row), summed_row, size);
        // The norm reads the rounded sum back (still in L1), exactly what the unfused ops normalise.
        normalize_row(summed_row, weights, out_data + row * size, size, static_cast<float>(eps), reduction_lanes);
      }
    });
  });
  return {out, summed};
}

// ---------------------------------------------------------------- rotary embedding (neox)

// Heads of one tensor ([tokens, heads * head_dim] or [tokens, heads, head_dim], last dim contiguous).
struct HeadLayout {
  int64_t num_heads = 0;
  int64_t token_stride = 0;
  int64_t head_stride = 0;
};

HeadLayout head_layout(const at::Tensor& x, int64_t num_tokens, int64_t head_dim, const char* name) {
  constexpr const char* op = "cpu_rotary_embedding";
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, op, ": ", name, " must be [tokens, heads * head_dim] or "
              "[tokens, heads, head_dim], got ", x.dim(), "-D");
  TORCH_CHECK(x.size(0) == num_tokens, op, ": ", name, " has ", x.size(0), " tokens, positions ", num_tokens);
  TORCH_CHECK(x.size(-1) <= 1 || x.stride(-1) == 1, op, ": ", name, "'s last dimension must be contiguous");
  HeadLayout layout;
  layout.token_stride = x.stride(0);
  if (x.dim() == 2) {
    TORCH_CHECK(x.size(1) % head_dim == 0, op, ": ", name, " width ", x.size(1), " is not a multiple of head_dim ",
                head_dim);
    layout.num_heads = x.size(1) / head_dim;
    layout.head_stride = head_dim;
  } else {
    TORCH_CHECK(x.size(2) == head_dim, op, ": ", name, " head size ", x.size(2), " != head_dim ", head_dim);
    layout.num_heads = x.size(1);
    layout.head_stride = x.stride(1);
  }
  return layout;
}

// values[i] rounded to scalar_t, as floats (the cos/sin table row cast to the dtype, as forward_native does).
template <typename scalar_t>
inline void round_row(const float* values, float* rounded, int64_t size) {
#if defined(PAGEDSERVE_ELEMENTWISE_AVX512)
  for (int64_t i = 0; i < size; i += kLanes) {
    const __mmask16 mask = lanes_mask(size - i);
    _mm512_mask_storeu_ps(rounded + i, mask, round_vector<scalar_t>(_mm512_maskz_loadu_ps(mask, values + i)));
  }
#else
  for (int64_t i = 0; i < size; ++i) rounded[i] = Storage<scalar_t>::round(values[i]);
#endif
}

// Rotates one head: out[i] = x[i] cos[i] - x[i + half] sin[i], out[i + half] = x[i + half] cos[i] + x[i] sin[i],
// with forward_native's rounding points: cos/sin already rounded to the dtype by the caller, each product
// rounded, the sum rounded.
template <typename scalar_t>
inline void rotate_head(const scalar_t* x, scalar_t* out, const float* cos, const float* sin, int64_t half) {
#if defined(PAGEDSERVE_ELEMENTWISE_AVX512)
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t i = 0; i < half; i += kLanes) {
    const __mmask16 mask = lanes_mask(half - i);
    const __m512 c = _mm512_maskz_loadu_ps(mask, cos + i);
    const __m512 s = _mm512_maskz_loadu_ps(mask, sin + i);
    const __m512 first = load_vector(x + i, mask);
    const __m512 second = load_vector(x + half + i, mask);
    const __m512 first_cos = round_vector<scalar_t>(_mm512_mul_ps(first, c));
    const __m512 second_cos = round_vector<scalar_t>(_mm512_mul_ps(second, c));
    const __m512 negated_second_sin = round_vector<scalar_t>(_mm512_mul_ps(_mm512_xor_ps(second, sign), s));
    const __m512 first_sin = round_vector<scalar_t>(_mm512_mul_ps(first, s));
    store_vector(out + i, _mm512_add_ps(first_cos, negated_second_sin), mask);
    store_vector(out + half + i, _mm512_add_ps(second_cos, first_sin), mask);
  }
#elif defined(PAGEDSERVE_AVX2)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < half; i += 8) {
    const int64_t count = std::min<int64_t>(8, half - i);
    const __m256 c = load_lanes8(cos + i, count);
    const __m256 s = load_lanes8(sin + i, count);
    const __m256 first = load_lanes8(x + i, count);
    const __m256 second = load_lanes8(x + half + i, count);
    const __m256 first_cos = round_lanes8<scalar_t>(_mm256_mul_ps(first, c));
    const __m256 second_cos = round_lanes8<scalar_t>(_mm256_mul_ps(second, c));
    const __m256 negated_second_sin = round_lanes8<scalar_t>(_mm256_mul_ps(_mm256_xor_ps(second, sign), s));
    const __m256 first_sin = round_lanes8<scalar_t>(_mm256_mul_ps(first, s));
    store_lanes8(out + i, _mm256_add_ps(first_cos, negated_second_sin), count);
    store_lanes8(out + half + i, _mm256_add_ps(second_cos, first_sin), count);
  }
#else
  using S = Storage<scalar_t>;
  for (int64_t i = 0; i < half; ++i) {
    const float c = cos[i];
    const float s = sin[i];
    const float first = S::load(x + i);
    const float second = S::load(x + half + i);
    const float first_cos = S::round(first * c);
    const float second_cos = S::round(second * c);
    const float negated_second_sin = S::round(-second * s);
    const float first_sin = S::round(first * s);
    S::store(out + i, first_cos + negated_second_sin);
    S::store(out + half + i, second_cos + first_sin);
  }
#endif
}

// One token's heads: the cos/sin row rounded to the dtype once (into `rounded_row`), shared by every head; the heads
// of query and key `*_head_stride` apart in, back to back out.
template <typename scalar_t>
void rotate_token_heads(const float* cos_sin_row, float* rounded_row, const scalar_t* query, int64_t query_head_stride,
                        int64_t num_query_heads, scalar_t* query_out, const scalar_t* key, int64_t key_head_stride,
                        int64_t num_key_heads, scalar_t* key_out, int64_t head_dim) {
  const float* cos = cos_sin_row;
  if constexpr (!std::is_same_v<scalar_t, float>) {
    round_row<scalar_t>(cos_sin_row, rounded_row, head_dim);
    cos = rounded_row;
  }
  const int64_t half = head_dim / 2;
  const float* sin = cos + half;
  for (int64_t head = 0; head < num_query_heads; ++head)
    rotate_head(query + head * query_head_stride, query_out + head * head_dim, cos, sin, half);
  for (int64_t head = 0; head < num_key_heads; ++head)
    rotate_head(key + head * key_head_stride, key_out + head * head_dim, cos, sin, half);
}

template <typename scalar_t, typename position_t>
void rotate_tokens(const position_t* positions, const at::Tensor& query, const HeadLayout& query_layout,
                   at::Tensor& query_out, const at::Tensor& key, const HeadLayout& key_layout, at::Tensor& key_out,
                   const float* cache, int64_t max_positions, int64_t head_dim, int64_t num_tokens) {
  const scalar_t* query_data = query.const_data_ptr<scalar_t>();
  const scalar_t* key_data = key.const_data_ptr<scalar_t>();
  scalar_t* query_destination = query_out.mutable_data_ptr<scalar_t>();
  scalar_t* key_destination = key_out.mutable_data_ptr<scalar_t>();
  const int64_t token_elements = (query_layout.num_heads + key_layout.num_heads) * head_dim;
  at::parallel_for(0, num_tokens, grain_rows(token_elements), [&](int64_t begin, int64_t end) {
    std::vector<float> rounded_table(head_dim);  // this token's cos/sin in the dtype
    for (int64_t token = begin; token < end; ++token) {
      const int64_t position = static_cast<int64_t>(positions[token]);
      TORCH_CHECK(position >= 0 && position < max_positions, "cpu_rotary_embedding: position ", position,
                  " is beyond the rotary table (max_positions=", max_positions, ")");
      // The row holds cos (half) then sin (half).
      rotate_token_heads(cache + position * head_dim, rounded_table.data(),
                         query_data + token * query_layout.token_stride, query_layout.head_stride,
                         query_layout.num_heads, query_destination + token * query_layout.num_heads * head_dim,
                         key_data + token * key_layout.token_stride, key_layout.head_stride, key_layout.num_heads,
                         key_destination + token * key_layout.num_heads * head_dim, head_dim);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& query,
                                                    const at::Tensor& key, const at::Tensor& cos_sin_cache,
                                                    int64_t head_dim) {
  constexpr const char* op = "cpu_rotary_embedding";
  check_floating(query, op, "query");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && key.device().is_cpu(), op,
              ": key must be a CPU tensor of the query's dtype");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, op, ": head_dim must be even, got ", head_dim);
  TORCH_CHECK(positions.device().is_cpu() && positions.dim() == 1 &&
                  (positions.scalar_type() == at::kLong || positions.scalar_type() == at::kInt),
              op, ": positions must be a 1-D int64 or int32 CPU tensor");
  TORCH_CHECK(cos_sin_cache.device().is_cpu() && cos_sin_cache.scalar_type() == at::kFloat &&
                  cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) == head_dim && cos_sin_cache.is_contiguous(),
              op, ": cos_sin_cache must be a contiguous float32 [max_positions, head_dim] CPU tensor");
  const int64_t num_tokens = positions.size(0);
  const HeadLayout query_layout = head_layout(query, num_tokens, head_dim, "query");
  const HeadLayout key_layout = head_layout(key, num_tokens, head_dim, "key");
  at::Tensor query_out = at::empty(query.sizes(), query.options());
  at::Tensor key_out = at::empty(key.sizes(), key.options());
  if (num_tokens == 0) return {query_out, key_out};
  const at::Tensor contiguous_positions = positions.contiguous();
  const float* cache = cos_sin_cache.const_data_ptr<float>();
  const int64_t max_positions = cos_sin_cache.size(0);
  dispatch_float_or_bfloat16(query.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    if (positions.scalar_type() == at::kLong)
      rotate_tokens<scalar_t>(contiguous_positions.const_data_ptr<int64_t>(), query, query_layout, query_out, key,
                              key_layout, key_out, cache, max_positions, head_dim, num_tokens);
    else
      rotate_tokens<scalar_t>(contiguous_positions.const_data_ptr<int32_t>(), query, query_layout, query_out, key,
                              key_layout, key_out, cache, max_positions, head_dim, num_tokens);
  });
  return {query_out, key_out};
}

// ---------------------------------------------------------------- SiLU and mul

#if defined(PAGEDSERVE_ELEMENTWISE_AVX512)
// round(silu(gate)) for 16 gates, by the formula (see the header).
template <typename scalar_t>
inline __m512 silu_vector(__m512 gate) {
  const __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_xor_ps(gate, _mm512_set1_ps(-0.0f))));
  return round_vector<scalar_t>(_mm512_div_ps(gate, denominator));
}

}  // namespace

namespace pagedserve_native {

// round(silu(g)) for every bfloat16 bit pattern g, computed once by silu_vector itself: a bf16 gate has only 2^16
// values, and a 128 KiB table (L2-resident) gathered 16 lanes at a time costs less than half of the formula's
// exp and division (2048 x 1536 gates: 1.62 -> 0.94 ms; a plain multiply of the same tensors 0.75 ms), with
// bitwise the same results. One spare entry at the end: the gather reads 4 bytes at each 2-byte index.
const uint16_t* bfloat16_silu_table() {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> values(65536 + 1, 0);
    for (int64_t first = 0; first < 65536; first += kLanes) {
      const __m512i bits = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(first)),
                                            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      const __m512 gate = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
      const __m512i silu = _mm512_srli_epi32(_mm512_castps_si512(silu_vector<c10::BFloat16>(gate)), 16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(values.data() + first), _mm512_cvtepi32_epi16(silu));
    }
    return values;
  }();
  return table.data();
}

}  // namespace pagedserve_native

namespace {
#endif

// out[i] = round(round(silu(gate[i])) * up[i]) for one row: gate = in[0:width], up = in[width:2 * width].
// `silu_table`: pagedserve_native::bfloat16_silu_table() for bfloat16 rows on AVX-512 (null otherwise).
template <typename scalar_t>
inline void silu_and_mul_row(const scalar_t* in, scalar_t* out, int64_t width, const uint16_t* silu_table) {
#if defined(PAGEDSERVE_ELEMENTWISE_AVX512)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const int* table = reinterpret_cast<const int*>(silu_table);
    for (int64_t i = 0; i < width; i += kLanes) {
      const __mmask16 mask = lanes_mask(width - i);
      // Masked-out lanes load 0: a valid index.
      const __m512i index = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, in + i));
      const __m512 silu = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_i32gather_epi32(index, table, 2), 16));
      store_vector(out + i, _mm512_mul_ps(silu, load_vector(in + width + i, mask)), mask);
    }
    return;
  }
  for (int64_t i = 0; i < width; i += kLanes) {
    const __mmask16 mask = lanes_mask(width - i);
    const __m512 silu = silu_vector<scalar_t>(load_vector(in + i, mask));
    store_vector(out + i, _mm512_mul_ps(silu, load_vector(in + width + i, mask)), mask);
  }
#elif defined(PAGEDSERVE_AVX2)
  // 8 lanes, ATen's AVX2 formula (Sleef_expf8_u10) for every element, the row's tail included.
  (void)silu_table;
  for (int64_t i = 0; i < width; i += 8) {
    const int64_t count = std::min<int64_t>(8, width - i);
    const __m256 gate = load_lanes8(in + i, count);
    const __m256 denominator =
        _mm256_add_ps(_mm256_set1_ps(1.0f), pagedserve_native::exp8(_mm256_xor_ps(gate, _mm256_set1_ps(-0.0f))));
    const __m256 silu = round_lanes8<scalar_t>(_mm256_div_ps(gate, denominator));
    store_lanes8(out + i, _mm256_mul_ps(silu, load_lanes8(in + width + i, count)), count);
  }
#else
  (void)silu_table;
  using S = Storage<scalar_t>;
  for (int64_t i = 0; i < width; ++i) {
    const float gate = S::load(in + i);
    const float silu = S::round(gate / (1.0f + std::exp(-gate)));
    S::store(out + i, silu * S::load(in + width + i));
  }
#endif
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  constexpr const char* op = "cpu_silu_and_mul";
  check_floating(x, op, "x");
  TORCH_CHECK(x.dim() == 1 || x.dim() == 2, op, ": x must be [2 * d] or [rows, 2 * d], got ", x.dim(), "-D");
  TORCH_CHECK(x.size(-1) % 2 == 0, op, ": the last dimension must be even, got ", x.size(-1));
  TORCH_CHECK(x.size(-1) <= 1 || x.stride(-1) == 1, op, ": x's last dimension must be contiguous");
  const int64_t width = x.size(-1) / 2;
  const int64_t rows = x.dim() == 2 ? x.size(0) : 1;
  const int64_t row_stride = x.dim() == 2 ? x.stride(0) : 0;
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = width;
  at::Tensor out = at::empty(sizes, x.options());
  if (width == 0 || rows == 0) return out;
  dispatch_float_or_bfloat16(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* source = x.const_data_ptr<scalar_t>();
    scalar_t* destination = out.mutable_data_ptr<scalar_t>();
    const uint16_t* silu_table = nullptr;
#if defined(PAGEDSERVE_ELEMENTWISE_AVX512)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) silu_table = pagedserve_native::bfloat16_silu_table();
#endif
    at::parallel_for(0, rows, grain_rows(2 * width), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row)
        silu_and_mul_row(source + row * row_stride, destination + row * width, width, silu_table);
    });
  });
  return out;
}

// The row kernels for callers that drive rows themselves (elementwise.h).
template <typename scalar_t>
void silu_and_mul_row_of(const scalar_t* in, scalar_t* out, int64_t width) {
  const uint16_t* silu_table = nullptr;
#if defined(PAGEDSERVE_ELEMENTWISE_AVX512)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) silu_table = pagedserve_native::bfloat16_silu_table();
#endif
  silu_and_mul_row(in, out, width, silu_table);
}

}  // namespace

namespace pagedserve_native {

#define PAGEDSERVE_ROW_KERNELS(scalar_t)                                                                           \
  void rms_norm_row(const scalar_t* x, const scalar_t* weight, scalar_t* out, int64_t size, float eps,             \
                    int64_t reduction_lanes) {                                                                     \
    normalize_row(x, weight, out, size, eps, reduction_lanes);                                                     \
  }                                                                                                                \
  void add_rms_norm_row(const scalar_t* x, const scalar_t* residual, const scalar_t* weight, scalar_t* out,         \
                        scalar_t* summed, int64_t size, float eps, int64_t reduction_lanes) {                      \
    add_row(x, residual, summed, size);                                                                            \
    normalize_row(summed, weight, out, size, eps, reduction_lanes);                                                \
  }                                                                                                                \
  void rotate_token(const float* cos_sin_row, float* rounded_row, const scalar_t* query, int64_t query_head_stride, \
                    int64_t num_query_heads, scalar_t* query_out, const scalar_t* key, int64_t key_head_stride,    \
                    int64_t num_key_heads, scalar_t* key_out, int64_t head_dim) {                                  \
    rotate_token_heads(cos_sin_row, rounded_row, query, query_head_stride, num_query_heads, query_out, key,        \
                       key_head_stride, num_key_heads, key_out, head_dim);                                         \
  }                                                                                                                \
  void silu_and_mul_row(const scalar_t* in, scalar_t* out, int64_t width) { silu_and_mul_row_of(in, out, width); }

PAGEDSERVE_ROW_KERNELS(float)
PAGEDSERVE_ROW_KERNELS(c10::BFloat16)
#undef PAGEDSERVE_ROW_KERNELS

}  // namespace pagedserve_native

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("cpu_rms_norm(Tensor x, Tensor weight, float eps, int reduction_lanes) -> Tensor");
  m.def("cpu_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, int reduction_lanes) "
        "-> (Tensor, Tensor)");
  m.def("cpu_rotary_embedding(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache, int head_dim) "
        "-> (Tensor, Tensor)");
  m.def("cpu_silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("cpu_rms_norm", &rms_norm);
  m.impl("cpu_add_rms_norm", &add_rms_norm);
  m.impl("cpu_rotary_embedding", &rotary_embedding);
  m.impl("cpu_silu_and_mul", &silu_and_mul);
}
