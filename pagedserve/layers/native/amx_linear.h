// amx_linear cut into the pieces a caller's own parallel region runs (amx_linear.cpp).
//
// pagedserve::amx_linear is: check and plan the product (this class's constructor), then run its work units
// (at::parallel_for over num_units()). models/native/decode_stack.cpp runs the same units inside the one parallel
// region of its decode step, so the two write the same bits: a unit's outputs never depend on which thread runs it
// or on the other units (amx_linear.cpp, "Work split and numerics").
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <memory>

namespace pagedserve_native {

class AmxLinearCall {
 public:
  // Checks the arguments as amx_linear does (raises c10::Error); `y` [M, n] (contiguous bfloat16) receives
  // x @ W^T + bias. `x`, `packed` and `bias` must outlive the call.
  AmxLinearCall(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n,
                c10::string_view products, at::Tensor y);
  ~AmxLinearCall();
  AmxLinearCall(const AmxLinearCall&) = delete;
  AmxLinearCall& operator=(const AmxLinearCall&) = delete;

  int64_t num_units() const;
  // Units [begin, end); disjoint ranges may run on different threads at once. Does not raise.
  void run_units(int64_t begin, int64_t end) const;

  struct State;

 private:
  std::unique_ptr<State> state_;
};

}  // namespace pagedserve_native
