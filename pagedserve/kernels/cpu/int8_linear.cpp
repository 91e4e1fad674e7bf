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
// Products: no AVX-512 VNNI on AVX2 machines, so the int8 values are widened to int16 and multiplied in pairs
// (vpmaddwd: 16 products per instruction, summed in int32; exact for every int8 pair, -128 included). A tile of
// kInputs x kColumns accumulators stays in registers while K streams through; each weight vector is widened once
// per tile and used for every input row of it. Decode (M = 1) reads the weight once: one byte per value, half of a
// bf16 weight's bytes.
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
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#define PAGEDSERVE_INT8_AVX2 1
#endif

namespace pagedserve_native {

namespace {

constexpr int64_t kColumnsPerUnit = 8;  // output columns per work unit (a multiple of every tile's kColumns)
constexpr int64_t kLanes = 16;          // int16 values per vector
constexpr float kDynamicMax = 127.0f;

}  // namespace

struct Int8LinearCall::State {
  int64_t m = 0, n = 0, k = 0;
  std::vector<int16_t> x_quants;  // [M, K] the quantized activation, widened to int16
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
template <class T>
void quantize_row(const T* x, int64_t k, float scale, float low, int16_t* quants) {
  for (int64_t i = 0; i < k; ++i) {
    const float q = std::nearbyint(to_float(x[i]) / scale);
    quants[i] = static_cast<int16_t>(std::min(std::max(q, low), kDynamicMax));
  }
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
      int16_t* quants = s.x_quants.data() + row * s.k;
      if (is_static) {
        s.x_scales[row] = static_scale;
        quantize_row(values, s.k, static_scale, -128.0f, quants);
      } else {
        // scale = absmax / 127; an all-zero row keeps scale 0 and divides by 1 (its quants are 0).
        const float scale = row_absmax(values, s.k) / kDynamicMax;
        s.x_scales[row] = scale;
        quantize_row(values, s.k, scale == 0.0f ? 1.0f : scale, -kDynamicMax, quants);
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
    for (int64_t i = 0; i < s.k; ++i) s.x_quants[row * s.k + i] = values[i];
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

int64_t grain_units(int64_t k, int64_t m) {
  // At least ~32 K multiply-adds of work per task: smaller tasks cost more to hand out than they take to run.
  return std::max<int64_t>(1, (32 * 1024) / std::max<int64_t>(1, kColumnsPerUnit * k * m));
}

}  // namespace

Int8LinearCall::Int8LinearCall(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                               const at::Tensor& input_scale, const at::Tensor& bias, at::Tensor y)
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
  s.x_quants.resize(s.m * s.k);
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
  return s.m == 0 ? 0 : (s.n + kColumnsPerUnit - 1) / kColumnsPerUnit;
}

int64_t Int8LinearCall::grain() const { return grain_units(state_->k, state_->m); }

void Int8LinearCall::run_units(int64_t begin, int64_t end) const {
  const State& s = *state_;
  const int64_t first = begin * kColumnsPerUnit, last = std::min(s.n, end * kColumnsPerUnit);
  if (first >= last) return;
  // Input rows four at a time against the units' columns: the columns' weights stay in L1/L2 across the groups.
  int64_t input = 0;
  for (; input + 4 <= s.m; input += 4) run_columns<4>(s, input, first, last);
  switch (s.m - input) {
    case 3: run_columns<3>(s, input, first, last); break;
    case 2: run_columns<2>(s, input, first, last); break;
    case 1: run_columns<1>(s, input, first, last); break;
    default: break;
  }
}

}  // namespace pagedserve_native

namespace {

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                       const c10::optional<at::Tensor>& input_scale, const c10::optional<at::Tensor>& bias,
                       c10::optional<at::ScalarType> out_dtype) {
  const at::ScalarType dtype = out_dtype.value_or(x.scalar_type());
  TORCH_CHECK(x.dim() == 2, "w8a8_linear: x [M, K] expected, got ", x.sizes());
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options().dtype(dtype));
  const pagedserve_native::Int8LinearCall call(x, weight, weight_scale, input_scale.value_or(at::Tensor()),
                                               bias.value_or(at::Tensor()), y);
  at::parallel_for(0, call.num_units(), call.grain(), [&](int64_t begin, int64_t end) { call.run_units(begin, end); });
  return y;
}

// Every build has the kernel (AVX2 products where the level has AVX2, the scalar loop elsewhere).
bool is_w8a8_linear_supported() { return true; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("w8a8_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? input_scale, Tensor? bias, "
        "ScalarType? out_dtype=None) -> Tensor");
  m.def("is_w8a8_linear_supported() -> bool", &is_w8a8_linear_supported);
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) { m.impl("w8a8_linear", &w8a8_linear); }
