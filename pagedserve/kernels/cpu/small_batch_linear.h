// small_batch_linear cut into the pieces a caller's own parallel region runs (small_batch_linear.cpp).
//
// pagedserve::small_batch_linear is: check the product (this class's constructor), then run its work units, blocks
// of four output columns (at::parallel_for over num_units() with grain()). kernels/cpu/decode_stack.cpp runs the
// same units inside the one parallel region of its decode step: a column's result never depends on which thread
// computes it or on the other columns (small_batch_linear.cpp, "Work split and numerics"), so the bits are the op's.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>

namespace pagedserve_native {

class SmallBatchLinearCall {
 public:
  // Checks the arguments as small_batch_linear does (raises c10::Error); `y` [M, N] (contiguous float32) receives
  // x @ W^T + bias. `x`, `weight` and `y` must outlive the call.
  SmallBatchLinearCall(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                       at::Tensor y);
  ~SmallBatchLinearCall();
  SmallBatchLinearCall(const SmallBatchLinearCall&) = delete;
  SmallBatchLinearCall& operator=(const SmallBatchLinearCall&) = delete;

  int64_t num_units() const;
  int64_t grain() const;  // units per parallel task in the op
  // Units [begin, end); disjoint ranges may run on different threads at once. Does not raise.
  void run_units(int64_t begin, int64_t end) const;

  struct State;

 private:
  std::unique_ptr<State> state_;
};

}  // namespace pagedserve_native
