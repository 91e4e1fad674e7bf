// GGUF-quantized linear cut into the pieces a caller's own parallel region runs (gguf_linear.cpp).
//
// pagedserve::gguf_linear is: check the product (this class's constructor), then run its work units, blocks of
// kRows output columns (at::parallel_for over num_units() with grain()). A column's result never depends on which
// thread computes it or on the other columns, so a caller running the units in its own region gets the op's bits.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace pagedserve_native {

// ggml block layouts the kernels read (enum ggml_type in ggml.h).
enum GgmlType : int64_t {
  kGgmlQ4_0 = 2,
  kGgmlQ4_1 = 3,
  kGgmlQ5_0 = 6,
  kGgmlQ5_1 = 7,
  kGgmlQ8_0 = 8,
  kGgmlQ4_K = 12,
  kGgmlQ5_K = 13,
  kGgmlQ6_K = 14,
};

// Values and bytes per block of a quantized ggml type (raises c10::Error for a type the kernels do not read).
struct GgmlBlockFormat {
  int64_t values;
  int64_t bytes;
};
GgmlBlockFormat ggml_block_format(int64_t ggml_type);

class GgufLinearCall {
 public:
  // Checks the arguments as gguf_linear does (raises c10::Error); `y` [M, N] (contiguous float32) receives
  // x @ dequantize(weight)^T + bias. `weight` is [N, bytes per row] uint8 in `ggml_type` blocks along K.
  // `x`, `weight` and `y` must outlive the call. The Q8_0 / Q4_0 / Q4_1 products quantize x here: make the call
  // once x holds its values. `products` names their unit: 'amx' (AMX-INT8 tiles, any M), 'vector' (M <= 64) or
  // 'auto' (amx where gguf_linear_products() lists it, else vector).
  GgufLinearCall(const at::Tensor& x, const at::Tensor& weight, int64_t ggml_type,
                 const c10::optional<at::Tensor>& bias, at::Tensor y, const std::string& products = "auto");
  ~GgufLinearCall();
  GgufLinearCall(const GgufLinearCall&) = delete;
  GgufLinearCall& operator=(const GgufLinearCall&) = delete;

  int64_t num_units() const;
  int64_t grain() const;  // units per parallel task in the op
  // Units [begin, end); disjoint ranges may run on different threads at once. Does not raise.
  void run_units(int64_t begin, int64_t end) const;

  struct State;

 private:
  std::unique_ptr<State> state_;
};

// The integer-product units this build and process can run, preferred first: 'amx' (the amx level with AMX-INT8,
// Linux granting the tile state), then 'vector'. Fixed for the process.
const std::vector<std::string>& gguf_linear_products();

// Whether the amx unit runs here and takes `ggml_type` (Q8_0, Q4_0, Q4_1): gguf_linear then runs batches of any size
// (layers/gguf_linear.py runs_on_kernel).
bool gguf_amx_takes(int64_t ggml_type);

// One row of `ggml_type` blocks (k values) decoded into out[0 : k] (the reference values; does not raise: the
// caller checked the type and k).
void gguf_decode_row(const uint8_t* row, int64_t ggml_type, int64_t k, float* out);

// Rows `row_ids` of a [V, bytes per row] ggml table as float32 [len(row_ids), K] (an embedding lookup); ids are
// range-checked (c10::Error naming the id and the table's rows).
at::Tensor gguf_rows(const at::Tensor& weight, int64_t ggml_type, int64_t k, const at::Tensor& row_ids);

}  // namespace pagedserve_native
