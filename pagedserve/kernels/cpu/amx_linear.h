// amx_linear and amx_linear_first_argmax cut into the pieces a caller's own parallel region runs (amx_linear.cpp).
//
// pagedserve::amx_linear is: check and plan the product (this class's constructor), then run its work units
// (at::parallel_for over num_units()). kernels/cpu/decode_stack.cpp runs the same units inside the one parallel
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

// amx_linear_first_argmax cut the same way: plan (the constructor), run the units, then merge (finish). The units'
// running maxima go to `slot`s: a slot is one thread's at a time, and the result does not depend on how the units
// were split between slots or in what order they ran (amx_linear.cpp).
class AmxFirstArgmaxCall {
 public:
  // Checks the arguments as amx_linear_first_argmax does (raises c10::Error) and keeps `num_slots` slots. x, packed
  // and bias must outlive the call; x is read when the units run, unless copies_x(K): then at construction.
  // `allowed` (structured outputs; allowed_tokens.h): int32 [M, words], each row's allowed tokens as bitmask words;
  // a disallowed column counts as -inf. It too must outlive the call.
  AmxFirstArgmaxCall(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n,
                     int64_t num_columns, c10::string_view products, int64_t num_slots,
                     const c10::optional<at::Tensor>& allowed = c10::nullopt);
  ~AmxFirstArgmaxCall();
  AmxFirstArgmaxCall(const AmxFirstArgmaxCall&) = delete;
  AmxFirstArgmaxCall& operator=(const AmxFirstArgmaxCall&) = delete;

  // Whether a K that is not a multiple of the packed step makes the constructor read x (into a zero-padded copy).
  static bool copies_x(int64_t k);
  int64_t num_units() const;
  // Units [begin, end) into slot `slot` (< num_slots); different slots may run on different threads at once. Does
  // not raise.
  void run_units(int64_t begin, int64_t end, int64_t slot) const;
  // out[M] = each row's first argmax, once every unit has run.
  void finish(int64_t* out) const;

  struct State;

 private:
  std::unique_ptr<State> state_;
};

}  // namespace pagedserve_native
