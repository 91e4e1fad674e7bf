// W8A8 int8 linear cut into the pieces a caller's own parallel region runs (int8_linear.cpp).
//
// pagedserve::w8a8_linear is: quantize x and check the product (this class's constructor), then run its work
// units, blocks of output columns (8, or 32 on the AMX tiles) (at::parallel_for over num_units() with grain()). A column's
// result never depends on which thread computes it or on the other columns, so a caller running the units in its
// own region gets the op's bits.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <memory>

namespace pagedserve_native {

class Int8LinearCall {
 public:
  // y[M, N] = ((x_q @ weight^T) * x_scale) * weight_scale + bias, rounded once to y's dtype.
  // - `x` [M, K] float32 or bfloat16 (quantized here: per token with input_scale undefined, else with the static
  //   one-value `input_scale`), or int8 already quantized (then `input_scale` holds its scales: [M, 1] or one value).
  // - `weight` int8 [N, K] contiguous; `weight_scale` float32 [N] (any shape with N values, contiguous);
  //   `bias` [N] of any float dtype or undefined; `y` contiguous float32 or bfloat16 [M, N].
  // - `products`: the product unit, 'auto' (AMX tiles from 16 rows where they run, else AVX512-VNNI where built,
  //   else the int16 products) or one of int8_linear_products(); every unit gives the same bits.
  // Raises c10::Error on a bad argument. The tensors must outlive the call.
  Int8LinearCall(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                 const at::Tensor& input_scale, const at::Tensor& bias, at::Tensor y,
                 c10::string_view products = "auto");
  ~Int8LinearCall();
  Int8LinearCall(const Int8LinearCall&) = delete;
  Int8LinearCall& operator=(const Int8LinearCall&) = delete;

  int64_t num_units() const;
  int64_t grain() const;  // units per parallel task in the op
  // Units [begin, end); disjoint ranges may run on different threads at once. Does not raise.
  void run_units(int64_t begin, int64_t end) const;

  struct State;

 private:
  std::unique_ptr<State> state_;
};

}  // namespace pagedserve_native
