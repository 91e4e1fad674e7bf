// The row kernels of elementwise.cpp, for callers that drive the rows themselves (kernels/cpu/decode_stack.cpp's
// one-region decode step, which has no tensors to allocate and no dispatcher to go through between its products).
//
// Each is the arithmetic the corresponding op applies to one row (token), so the results are bitwise the op's:
// - rms_norm_row: cpu_rms_norm; add_rms_norm_row: cpu_add_rms_norm (`summed` may be `residual` itself: each element
//   is read before it is written);
// - rotate_token: cpu_rotary_embedding for one token, neox layout: `cos_sin_row` is the token's row of the float32
//   cos/sin cache (cos then sin, head_dim values), `rounded_row` head_dim floats of scratch; the heads of the query
//   and key are `*_head_stride` apart and written back to back (head_dim apart) to `*_out`;
// - silu_and_mul_row: cpu_silu_and_mul, gate = in[0:width], up = in[width:2 * width].
// Pointers are to contiguous rows; nothing is checked.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace pagedserve_native {

#define PAGEDSERVE_DECLARE_ROW_KERNELS(scalar_t)                                                                   \
  void rms_norm_row(const scalar_t* x, const scalar_t* weight, scalar_t* out, int64_t size, float eps,             \
                    int64_t reduction_lanes);                                                                      \
  void add_rms_norm_row(const scalar_t* x, const scalar_t* residual, const scalar_t* weight, scalar_t* out,         \
                        scalar_t* summed, int64_t size, float eps, int64_t reduction_lanes);                       \
  void rotate_token(const float* cos_sin_row, float* rounded_row, const scalar_t* query, int64_t query_head_stride, \
                    int64_t num_query_heads, scalar_t* query_out, const scalar_t* key, int64_t key_head_stride,    \
                    int64_t num_key_heads, scalar_t* key_out, int64_t head_dim);                                   \
  void silu_and_mul_row(const scalar_t* in, scalar_t* out, int64_t width);

PAGEDSERVE_DECLARE_ROW_KERNELS(float)
PAGEDSERVE_DECLARE_ROW_KERNELS(c10::BFloat16)
#undef PAGEDSERVE_DECLARE_ROW_KERNELS

}  // namespace pagedserve_native
