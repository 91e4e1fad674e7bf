// float32 linear for decode-sized batches: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M <= 128, AVX-512.
//
// Python side: layers/small_batch_linear.py. With a handful of rows a linear streams its weight once per step and
// reuses each weight vector for every row from registers, so its speed is the memory bandwidth the loop
// sustains. MKL's sgemm on the plain [N, K] weight (what F.linear runs) sustained 25.2 / 22.7 / 14.9 / 12.0 /
// 10.8 GB/s at M = 1 / 2 / 4 / 8 / 16 from DRAM on this machine; this loop, which streams four weight rows at a
// time and software-prefetches each row a few KiB ahead (the hardware prefetcher does not run far enough ahead
// on its own), sustained 26.0 / 26.2 / 24.5 / 19.5 / 14.7 GB/s (benchmarks/small_batch_linear.py). A second,
// 8x farther prefetch into L2/L3 added 15-17% on a decode step's sequence of weights (in a slow phase of this
// VM: 13.8-14.6 -> 16.2-17.2 GB/s, torch's sum 18.8 GB/s at the time). One to three input rows (decode steps of
// a few requests) stream differently since: six (three rows: four) weight rows from as many stretches of a thread's
// share at a time, each read front to back, no software prefetch (stream_rows; one row 1.15x, two 1.25x on a decode
// step's weights on a Zen 4 VM).
//
// Larger batches (decode steps of many requests) are compute-bound: input rows go five at a time against the four
// weight rows (20 accumulators, 9 loads per 20 FMA), the weight rows staying in L1 while x streams from L2. On an
// AMD Zen 4 VM over SmolLM2-135M's 30 layers of linears, against oneDNN's GEMM on the same plain weight (which
// reorders it every call): 1.3x at 24-64 rows, 1.12x at 128, 0.95x at 256 (groups of four: 1.07x at 64). Python
// sends batches of up to 128 rows here off Intel and up to 16 on Intel, where MKL's sgemm takes the rest
// (layers/small_batch_linear.py).
//
// Work split and numerics:
// - Weight rows (output columns) are split between torch's intra-op threads in blocks of kRows rows; each
//   thread streams a contiguous range of the weight and computes those columns for every input row.
// - One output element = one 16-lane fp32 accumulator over K in order (16 products per step, one FMA per
//   lane; a K tail is masked to zero), then _mm512_reduce_add_ps, then + bias. The order depends only on K:
//   a row's result does not depend on M, on the other rows or on the thread count (batch invariant), but it
//   is not bitwise equal to MKL's sgemm (another summation order); tests compare both with float64.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-fast-math")
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "small_batch_linear.h"

#include "vector_avx2.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDSERVE_SMALL_BATCH_LINEAR 1
#elif defined(PAGEDSERVE_AVX2)
#define PAGEDSERVE_SMALL_BATCH_LINEAR 1
#endif

namespace {

constexpr int64_t kRows = 4;         // weight rows streamed together (one register each)
constexpr int64_t kMaxInputs = 128;  // largest M the op accepts
constexpr int64_t kFarPrefetchFactor = 8;  // the far prefetch distance, in near distances

// The level's float vector: AVX-512's 16 lanes, or AVX2's 8 (16 registers, not 32: input rows go at most
// kMaxTileInputs at a time, so that a tile's accumulators and weight rows stay in registers).
#if defined(__AVX512F__)
using Vector = __m512;
constexpr int64_t kLanes = 16;
constexpr int64_t kMaxTileInputs = 5;

// Loads x[offset : offset + 16] (fewer at the K tail, the rest zero).
inline __m512 load_lanes(const float* source, int64_t count) {
  if (count >= kLanes) return _mm512_loadu_ps(source);
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1u), source);
}
inline __m512 zero_vector() { return _mm512_setzero_ps(); }
inline __m512 multiply_add(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline float reduce_add(__m512 v) { return _mm512_reduce_add_ps(v); }
#elif defined(PAGEDSERVE_AVX2)
using Vector = __m256;
constexpr int64_t kLanes = 8;
constexpr int64_t kMaxTileInputs = 3;

inline __m256 load_lanes(const float* source, int64_t count) {
  return count >= kLanes ? _mm256_loadu_ps(source) : pagedserve_native::load8_partial(source, count);
}
inline __m256 zero_vector() { return _mm256_setzero_ps(); }
inline __m256 multiply_add(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
inline float reduce_add(__m256 v) { return pagedserve_native::horizontal_sum8(v); }
#endif

#if defined(PAGEDSERVE_SMALL_BATCH_LINEAR)

// Columns [row, row + kNumRows) of y for kNumInputs input rows.
template <int64_t kNumInputs, int64_t kNumRows>
inline void gemm_tile(const float* x, int64_t x_stride, const float* weight_rows, int64_t k, const float* bias,
                      float* y, int64_t y_stride, int64_t row, int64_t prefetch_bytes) {
  Vector acc[kNumRows][kNumInputs];
#pragma GCC unroll 16
  for (int64_t r = 0; r < kNumRows; ++r)
#pragma GCC unroll 16
    for (int64_t i = 0; i < kNumInputs; ++i) acc[r][i] = zero_vector();
  for (int64_t offset = 0; offset < k; offset += kLanes) {
    const int64_t count = k - offset;
    Vector w[kNumRows];
#pragma GCC unroll 16
    for (int64_t r = 0; r < kNumRows; ++r) {
      const float* source = weight_rows + r * k + offset;
      if (prefetch_bytes > 0) {
        // Two distances: to L1 just ahead, and to L2/L3 8x further. One core keeps only a few L1 misses in
        // flight; the far prefetches are held further out, so more of the stream is in flight at once
        // (measured +15-17% over the near prefetch alone on a layer-by-layer sequence of SmolLM2's weights).
        _mm_prefetch(reinterpret_cast<const char*>(source) + prefetch_bytes, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(source) + kFarPrefetchFactor * prefetch_bytes, _MM_HINT_T2);
      }
      w[r] = load_lanes(source, count);
    }
#pragma GCC unroll 16
    for (int64_t i = 0; i < kNumInputs; ++i) {
      const Vector input = load_lanes(x + i * x_stride + offset, count);
#pragma GCC unroll 16
      for (int64_t r = 0; r < kNumRows; ++r) acc[r][i] = multiply_add(w[r], input, acc[r][i]);
    }
  }
#pragma GCC unroll 16
  for (int64_t r = 0; r < kNumRows; ++r)
#pragma GCC unroll 16
    for (int64_t i = 0; i < kNumInputs; ++i) {
      float value = reduce_add(acc[r][i]);
      if (bias != nullptr) value += bias[row + r];
      y[i * y_stride + row + r] = value;
    }
}

// All input rows against weight rows [row, row + kNumRows): input rows in groups of up to kMaxTileInputs (the weight rows
// stay in L1 between groups; only the first group prefetches the stream ahead).
template <int64_t kNumRows>
void gemm_rows(const float* x, int64_t x_stride, int64_t m, const float* weight, int64_t k, const float* bias,
               float* y, int64_t n, int64_t row, int64_t prefetch_bytes) {
  const float* weight_rows = weight + row * k;
  for (int64_t input = 0; input < m;) {
    const int64_t left = m - input;
    const float* xi = x + input * x_stride;
    float* yi = y + input * n;
    const int64_t prefetch = input == 0 ? prefetch_bytes : 0;
    if (left >= 5 && kMaxTileInputs >= 5) {
      gemm_tile<5, kNumRows>(xi, x_stride, weight_rows, k, bias, yi, n, row, prefetch);
      input += 5;
    } else if (left >= 4 && kMaxTileInputs >= 4) {
      gemm_tile<4, kNumRows>(xi, x_stride, weight_rows, k, bias, yi, n, row, prefetch);
      input += 4;
    } else if (left >= 3) {
      gemm_tile<3, kNumRows>(xi, x_stride, weight_rows, k, bias, yi, n, row, prefetch);
      input += 3;
    } else if (left == 2) {
      gemm_tile<2, kNumRows>(xi, x_stride, weight_rows, k, bias, yi, n, row, prefetch);
      input += 2;
    } else {
      gemm_tile<1, kNumRows>(xi, x_stride, weight_rows, k, bias, yi, n, row, prefetch);
      input += 1;
    }
  }
}

// One to kMaxStreamInputs input rows stream: up to kMaxStreams weight rows at a time, each from its own stretch of the thread's
// rows and each read front to back, with no software prefetch. The hardware prefetcher then runs one stream per
// stretch. On the Zen 4 VM, the 121 float32 products of a SmolLM2-135M decode step (layers and LM head) on the same
// buffers, interleaved over five rounds (medians, relative to four rows together with the two prefetch distances):
// one row at a time 1.02x, 2 / 4 / 6 / 8 streams 1.08 / 1.10 / 1.15 / 1.11x. The 120 layer products at 2 / 3 / 4
// input rows, six rounds: 6 streams 1.25 / 1.05 / 0.96x, 4 streams 1.26 / 1.10 / 0.88x, 3 streams 1.25 / 1.07 /
// 0.90x; four rows and more keep gemm_rows. The results are gemm_tile's bitwise: one accumulator per output over K
// in order.
constexpr int kMaxStreams = 6;
#if defined(__AVX512F__)
constexpr int kMaxStreamInputs = 3;
constexpr int num_streams(int64_t num_inputs) { return num_inputs == 3 ? 4 : kMaxStreams; }
#else
// AVX2 (16 registers): up to five input rows stream (five as three, then two), with as many streams as keep the
// accumulators and the live inputs or weights in registers. gemm_rows from four rows on took 1.38x the time of three
// streaming rows for SmolLM2-135M's 90 layer products (zen-avx2: 1 / 3 / 4 / 5 rows 24.8 / 30.8 / 42.6 /
// 46.5 ms), which made a speculative 5-token verification cost 1.9x a decode step.
constexpr int kMaxStreamInputs = 5;
constexpr int num_streams(int64_t num_inputs) {
  return num_inputs <= 2 ? kMaxStreams : num_inputs == 3 ? 4 : num_inputs == 4 ? 3 : 2;
}
#endif

template <int kInputs, int kStreams>
inline void row_streams(const float* x, int64_t x_stride, const float* const* weight_rows, int64_t k, float* out) {
  Vector acc[kStreams][kInputs];
#pragma GCC unroll 8
  for (int stream = 0; stream < kStreams; ++stream)
#pragma GCC unroll 8
    for (int i = 0; i < kInputs; ++i) acc[stream][i] = zero_vector();
  for (int64_t offset = 0; offset < k; offset += kLanes) {
    if constexpr (kStreams < kInputs) {
      // More inputs than streams (AVX2's 4 and 5 rows): the streams' weights stay in registers and each input is
      // loaded in turn, kStreams + 1 live vectors beside the accumulators instead of kInputs + 1. Each
      // accumulator still sums over K in order: the same bits either way.
      Vector w[kStreams];
#pragma GCC unroll 8
      for (int stream = 0; stream < kStreams; ++stream) w[stream] = load_lanes(weight_rows[stream] + offset, k - offset);
#pragma GCC unroll 8
      for (int i = 0; i < kInputs; ++i) {
        const Vector input = load_lanes(x + i * x_stride + offset, k - offset);
#pragma GCC unroll 8
        for (int stream = 0; stream < kStreams; ++stream)
          acc[stream][i] = multiply_add(w[stream], input, acc[stream][i]);
      }
    } else {
      Vector inputs[kInputs];
#pragma GCC unroll 4
      for (int i = 0; i < kInputs; ++i) inputs[i] = load_lanes(x + i * x_stride + offset, k - offset);
#pragma GCC unroll 8
      for (int stream = 0; stream < kStreams; ++stream) {
        const Vector w = load_lanes(weight_rows[stream] + offset, k - offset);
#pragma GCC unroll 4
        for (int i = 0; i < kInputs; ++i) acc[stream][i] = multiply_add(w, inputs[i], acc[stream][i]);
      }
    }
  }
#pragma GCC unroll 8
  for (int stream = 0; stream < kStreams; ++stream)
#pragma GCC unroll 4
    for (int i = 0; i < kInputs; ++i) out[stream * kInputs + i] = reduce_add(acc[stream][i]);
}

// row_streams for `count` (1 to kMaxStreams) streams.
template <int kInputs>
inline void streams_of(int count, const float* x, int64_t x_stride, const float* const* weight_rows, int64_t k,
                       float* out) {
  switch (count) {
    case 6: row_streams<kInputs, 6>(x, x_stride, weight_rows, k, out); break;
    case 5: row_streams<kInputs, 5>(x, x_stride, weight_rows, k, out); break;
    case 4: row_streams<kInputs, 4>(x, x_stride, weight_rows, k, out); break;
    case 3: row_streams<kInputs, 3>(x, x_stride, weight_rows, k, out); break;
    case 2: row_streams<kInputs, 2>(x, x_stride, weight_rows, k, out); break;
    default: row_streams<kInputs, 1>(x, x_stride, weight_rows, k, out); break;
  }
}

// Columns [begin, end) of y for kInputs input rows, num_streams stretches at a time. Five rows go as a group of
// three, streaming the weights from memory, then a group of two over the same weight rows, read again from L1/L2
// (five rows in one group leave AVX2 registers for two streams only, and two streams are too few to keep memory
// busy: 66 ms against 34.9 ms for four rows over SmolLM2's layer products, zen-avx2).
template <int kInputs>
void stream_rows(const float* x, int64_t x_stride, const float* weight, int64_t k, const float* bias, float* y,
                 int64_t y_stride, int64_t begin, int64_t end) {
  constexpr int kFirst = kInputs <= 4 ? kInputs : 4;
  constexpr int kSecond = kInputs - kFirst;
  const int64_t num_rows = end - begin;
  if (num_rows <= 0) return;
  const int64_t stretch = (num_rows + num_streams(kFirst) - 1) / num_streams(kFirst);
  for (int64_t i = 0; i < stretch; ++i) {
    const float* weight_rows[kMaxStreams];
    int64_t columns[kMaxStreams];
    int count = 0;
    for (int64_t column = begin + i; column < end; column += stretch) {
      weight_rows[count] = weight + column * k;
      columns[count++] = column;
    }
    float first[kMaxStreams * kFirst];
    streams_of<kFirst>(count, x, x_stride, weight_rows, k, first);
    float second[kMaxStreams * (kSecond > 0 ? kSecond : 1)];
    if constexpr (kSecond > 0) streams_of<kSecond>(count, x + kFirst * x_stride, x_stride, weight_rows, k, second);
    for (int j = 0; j < count; ++j)
      for (int input = 0; input < kInputs; ++input) {
        float value = input < kFirst ? first[j * kFirst + input] : second[j * (kSecond > 0 ? kSecond : 1) + input - kFirst];
        if (bias != nullptr) value += bias[columns[j]];
        y[input * y_stride + columns[j]] = value;
      }
  }
}
static_assert(kMaxStreams == 6, "stream_rows dispatches up to 6 streams");

#endif  // PAGEDSERVE_SMALL_BATCH_LINEAR

// Weight bytes per parallel task: at least ~64 KiB, so a thread streams long contiguous ranges.
int64_t grain_units(int64_t k) { return std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, kRows * k * 4)); }

}  // namespace

namespace pagedserve_native {

struct SmallBatchLinearCall::State {
  at::Tensor bias;
  const float* x = nullptr;
  const float* weight = nullptr;
  const float* bias_data = nullptr;
  float* y = nullptr;
  int64_t m = 0, n = 0, k = 0, x_stride = 0;
};

SmallBatchLinearCall::SmallBatchLinearCall(const at::Tensor& x, const at::Tensor& weight,
                                           const c10::optional<at::Tensor>& bias, at::Tensor y)
    : state_(std::make_unique<State>()) {
#if defined(PAGEDSERVE_SMALL_BATCH_LINEAR)
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "small_batch_linear: x [M, K] and weight [N, K] expected, got ",
              x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "small_batch_linear: float32 x and weight expected");
  TORCH_CHECK(x.size(1) == weight.size(1), "small_batch_linear: x has ", x.size(1), " columns, weight ",
              weight.size(1));
  TORCH_CHECK(x.size(0) <= kMaxInputs, "small_batch_linear: M=", x.size(0), " exceeds ", kMaxInputs);
  TORCH_CHECK(weight.is_contiguous() && x.stride(1) == 1, "small_batch_linear: contiguous weight rows and x rows "
              "expected");
  State& s = *state_;
  s.m = x.size(0);
  s.n = weight.size(0);
  s.k = x.size(1);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == s.n && bias->scalar_type() == at::kFloat,
                "small_batch_linear: a float32 bias of ", s.n, " values expected");
    s.bias = bias->contiguous();
    s.bias_data = s.bias.data_ptr<float>();
  }
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous() && y.sizes() == at::IntArrayRef({s.m, s.n}),
              "small_batch_linear: the output must be a contiguous float32 [", s.m, ", ", s.n, "] tensor");
  s.x = x.data_ptr<float>();
  s.x_stride = x.stride(0);
  s.weight = weight.data_ptr<float>();
  s.y = y.data_ptr<float>();
#else
  (void)x, (void)weight, (void)bias, (void)y;
  TORCH_CHECK(false, "small_batch_linear: this build has no AVX2 or AVX-512 kernel (is_small_batch_linear_supported() "
              "is False here)");
#endif
}

SmallBatchLinearCall::~SmallBatchLinearCall() = default;

int64_t SmallBatchLinearCall::num_units() const {
  const State& s = *state_;
  return s.m == 0 ? 0 : (s.n + kRows - 1) / kRows;
}

int64_t SmallBatchLinearCall::grain() const { return grain_units(state_->k); }

void SmallBatchLinearCall::run_units(int64_t begin, int64_t end) const {
#if defined(PAGEDSERVE_SMALL_BATCH_LINEAR)
  const State& s = *state_;
  const int64_t first_column = begin * kRows, end_column = std::min(s.n, end * kRows);
  if (first_column >= end_column) return;
  if (s.m <= kMaxStreamInputs) {
    if (s.m == 1) stream_rows<1>(s.x, s.x_stride, s.weight, s.k, s.bias_data, s.y, s.n, first_column, end_column);
    else if (s.m == 2) stream_rows<2>(s.x, s.x_stride, s.weight, s.k, s.bias_data, s.y, s.n, first_column, end_column);
    else if (s.m == 3) stream_rows<3>(s.x, s.x_stride, s.weight, s.k, s.bias_data, s.y, s.n, first_column, end_column);
    else if constexpr (kMaxStreamInputs >= 5) {
      if (s.m == 4) stream_rows<4>(s.x, s.x_stride, s.weight, s.k, s.bias_data, s.y, s.n, first_column, end_column);
      else stream_rows<5>(s.x, s.x_stride, s.weight, s.k, s.bias_data, s.y, s.n, first_column, end_column);
    }
    return;
  }
  // Measured best from four rows on (up to three stream without software prefetch, above).
  const int64_t prefetch_bytes = 8192;
  int64_t column = first_column;
  for (; column + kRows <= end_column; column += kRows)
    gemm_rows<kRows>(s.x, s.x_stride, s.m, s.weight, s.k, s.bias_data, s.y, s.n, column, prefetch_bytes);
  for (; column < end_column; ++column)  // the last < kRows columns
    gemm_rows<1>(s.x, s.x_stride, s.m, s.weight, s.k, s.bias_data, s.y, s.n, column, 0);
#else
  (void)begin, (void)end;
#endif
}

}  // namespace pagedserve_native

namespace {

at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "small_batch_linear: x [M, K] and weight [N, K] expected, got ",
              x.sizes(), " and ", weight.sizes());
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  const pagedserve_native::SmallBatchLinearCall call(x, weight, bias, y);
  at::parallel_for(0, call.num_units(), call.grain(), [&](int64_t begin, int64_t end) { call.run_units(begin, end); });
  return y;
}

bool is_small_batch_linear_supported() {
#if defined(PAGEDSERVE_SMALL_BATCH_LINEAR)
  return true;
#else
  return false;
#endif
}

int64_t small_batch_linear_max_rows() { return kMaxInputs; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("small_batch_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  // No tensor arguments to dispatch on: catch-all kernels.
  m.def("is_small_batch_linear_supported() -> bool", &is_small_batch_linear_supported);
  m.def("small_batch_linear_max_rows() -> int", &small_batch_linear_max_rows);
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) { m.impl("small_batch_linear", &small_batch_linear); }
