// Greedy sampling's argmax on the CPU: the first index of each row's maximum, a NaN counting as larger than
// everything (the first NaN wins), exactly what `logits.max(dim=-1).indices` returns.
//
// Python side: sample/greedy.py (first_argmax). ATen's max(dim) tracks the index lane by lane in a scalar loop;
// the two-level form in greedy.py (vectorised amax per block of 1024, then max over one block) took ~1.2 ms for
// [64, 49152] bfloat16 on this machine, a visible part of a batch-64 decode step. Here a row is read twice while
// it sits in L2: a vectorised pass takes its maximum and notes any NaN, a second finds the first column equal to
// the maximum (or the first NaN) with one comparison per 16 columns.
//
// Op: pagedserve::cpu_first_argmax(Tensor logits [rows, vocab] float32 or bfloat16, unit column stride)
//     -> Tensor [rows] int64
// Exactness: bfloat16 widens to float32 exactly, so the comparisons are those of the reference. -0.0 and +0.0
// compare equal in both (the first of them wins). A row of -inf returns 0. Rows are split between torch's
// intra-op threads; each row is one thread's, so the result does not depend on the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "first_argmax.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGEDSERVE_ARGMAX_AVX512 1
#endif

namespace {

inline float widen(float value) { return value; }
inline float widen(c10::BFloat16 value) { return static_cast<float>(value); }

#if defined(PAGEDSERVE_ARGMAX_AVX512)
constexpr int64_t kLanes = 16;

inline __mmask16 lanes_mask(int64_t count) {
  return count >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1u);
}

// 16 values from `row` (masked lanes: `fill`), as float32.
inline __m512 load16(const float* row, __mmask16 mask, __m512 fill) { return _mm512_mask_loadu_ps(fill, mask, row); }

inline __m512 load16(const c10::BFloat16* row, __mmask16 mask, __m512 fill) {
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, row);
  const __m512 value = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  return _mm512_mask_mov_ps(fill, mask, value);
}

template <typename scalar_t>
int64_t row_first_argmax(const scalar_t* row, int64_t size) {
  const __m512 minus_infinity = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 maximum = minus_infinity;
  __mmask16 any_nan = 0;
  for (int64_t column = 0; column < size; column += kLanes) {
    const __m512 value = load16(row + column, lanes_mask(size - column), minus_infinity);
    any_nan |= _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
    maximum = _mm512_max_ps(maximum, value);
  }
  const float target = _mm512_reduce_max_ps(maximum);
  for (int64_t column = 0; column < size; column += kLanes) {
    const __mmask16 mask = lanes_mask(size - column);
    const __m512 value = load16(row + column, mask, minus_infinity);
    const __mmask16 hit = any_nan != 0 ? _mm512_mask_cmp_ps_mask(mask, value, value, _CMP_UNORD_Q)
                                       : _mm512_mask_cmp_ps_mask(mask, value, _mm512_set1_ps(target), _CMP_EQ_OQ);
    if (hit != 0) return column + __builtin_ctz(static_cast<unsigned>(hit));
  }
  return 0;  // unreachable: the maximum (or the NaN) is in the row
}
#else
template <typename scalar_t>
int64_t row_first_argmax(const scalar_t* row, int64_t size) {
  int64_t best = 0;
  float best_value = widen(row[0]);
  if (std::isnan(best_value)) return 0;
  for (int64_t column = 1; column < size; ++column) {
    const float value = widen(row[column]);
    if (std::isnan(value)) return column;
    if (value > best_value) {
      best_value = value;
      best = column;
    }
  }
  return best;
}
#endif

at::Tensor first_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "cpu_first_argmax: logits must be a 2-D float32 or bfloat16 CPU tensor, got ", logits.sizes(), " ",
              logits.scalar_type(), " on ", logits.device());
  const int64_t rows = logits.size(0), size = logits.size(1);
  TORCH_CHECK(size > 0, "cpu_first_argmax: the vocabulary dimension is empty");
  TORCH_CHECK(size == 1 || logits.stride(1) == 1, "cpu_first_argmax: logits need a unit column stride, got stride ",
              logits.stride(1));
  at::Tensor indices = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* out = indices.data_ptr<int64_t>();
  const int64_t row_stride = logits.stride(0);
  // A row per task unless rows are short: one 49152-column row is ~50 us of work, worth a thread.
  const int64_t grain = std::max<int64_t>(1, 16384 / size);
  AT_DISPATCH_SWITCH(logits.scalar_type(), "cpu_first_argmax",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        const float* data = logits.const_data_ptr<float>();
        at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
          for (int64_t row = begin; row < end; ++row) out[row] = row_first_argmax(data + row * row_stride, size);
        });
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        const c10::BFloat16* data = logits.const_data_ptr<c10::BFloat16>();
        at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
          for (int64_t row = begin; row < end; ++row) out[row] = row_first_argmax(data + row * row_stride, size);
        });
      }));
  return indices;
}

}  // namespace

namespace pagedserve_native {

int64_t first_argmax_row(const float* row, int64_t size) { return row_first_argmax(row, size); }

}  // namespace pagedserve_native

TORCH_LIBRARY_FRAGMENT(pagedserve, m) { m.def("cpu_first_argmax(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) { m.impl("cpu_first_argmax", &first_argmax); }
