// GGUF-quantized linear cut into the pieces a caller's own parallel region runs (gguf_linear.cpp).
//
// pagedserve::gguf_linear is: check the product (this class's constructor), then run its work units, blocks of
// output columns (4; 16 on the amx unit and on the interleaved layouts) (at::parallel_for over num_units() with
// grain()). A column's result never depends on which
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

// Interleaved layouts of the integer-product types (gguf_interleave): the same blocks, 16 consecutive rows at a
// time rearranged so that one 64-byte vector holds 4 consecutive quants of each of the 16 rows (the layout of an
// AMX B tile and of a VPDPBUSD operand). Their type ids are the ggml type's + kInterleavedTypeOffset. The weight
// keeps its [N, bytes per row] shape (N a multiple of 16), and row groups stay whole under slicing by 16 rows.
//
// Group g (rows 16 g .. 16 g + 15) takes bytes [16 g, 16 g + 16) x bytes per row; within it, block b's 16 blocks
// take 16 x (block bytes) bytes from 16 b x (block bytes):
//   quants: chunk r (64 bytes; 4 chunks for Q4_0 / Q4_1, 8 for Q8_0) holds, for row c = 0 .. 15, the block's quant
//     bytes 4r .. 4r + 3 at bytes 4c .. 4c + 3 (Q4: byte i is value i in its low nibble, value 16 + i in its high);
//   then d of the 16 rows (float16), then Q4_1's m of the 16 rows.
constexpr int64_t kInterleavedTypeOffset = 256;
constexpr int64_t kInterleavedRows = 16;
enum InterleavedType : int64_t {
  kGgmlQ4_0x16 = kGgmlQ4_0 + kInterleavedTypeOffset,
  kGgmlQ4_1x16 = kGgmlQ4_1 + kInterleavedTypeOffset,
  kGgmlQ8_0x16 = kGgmlQ8_0 + kInterleavedTypeOffset,
};
inline bool is_interleaved_type(int64_t type) {
  return type == kGgmlQ4_0x16 || type == kGgmlQ4_1x16 || type == kGgmlQ8_0x16;
}
// The ggml type whose blocks a type holds (itself for a ggml type).
inline int64_t block_type_of(int64_t type) { return is_interleaved_type(type) ? type - kInterleavedTypeOffset : type; }

// Values and bytes per block of a quantized ggml type or of its interleaved layout (raises c10::Error for a type the
// kernels do not read).
struct GgmlBlockFormat {
  int64_t values;
  int64_t bytes;
};
GgmlBlockFormat ggml_block_format(int64_t ggml_type);

// `weight` [N, bytes per row] of Q8_0 / Q4_0 / Q4_1 blocks in the interleaved layout of `ggml_type` (a new tensor of
// the same shape; raises c10::Error unless N is a multiple of 16 and the type has an interleaved layout).
at::Tensor gguf_interleave(const at::Tensor& weight, int64_t ggml_type);

// Whether this build's products read `ggml_type`'s interleaved blocks with vector instructions (every type at AVX2
// and above; a build without AVX2 runs a scalar loop that computes the same bits): where the model loader interleaves.
bool gguf_interleaved_is_fast(int64_t ggml_type);

class GgufLinearCall {
 public:
  // Checks the arguments as gguf_linear does (raises c10::Error); `y` [M, N] (float32, contiguous rows: it may be a
  // column range of a wider output) receives x @ dequantize(weight)^T + bias. `weight` is [N, bytes per row] uint8 in
  // `ggml_type` blocks along K. `x`, `weight` and `y` must outlive the call. The products quantize x here: make the call
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

// Whether the amx unit runs here and takes `ggml_type` (Q8_0, Q4_0, Q4_1, Q4_K): gguf_linear then runs batches of any
// size (layers/gguf_linear.py runs_on_kernel).
bool gguf_amx_takes(int64_t ggml_type);

// Row `row` of a table of `ggml_type` blocks (k values, row_bytes per row; either layout) decoded into out[0 : k]
// (the reference values; does not raise: the caller checked the type and k).
void gguf_decode_row(const uint8_t* table, int64_t row_bytes, int64_t row, int64_t ggml_type, int64_t k, float* out);

// Rows `row_ids` of a [V, bytes per row] ggml table as float32 [len(row_ids), K] (an embedding lookup); ids are
// range-checked (c10::Error naming the id and the table's rows).
at::Tensor gguf_rows(const at::Tensor& weight, int64_t ggml_type, int64_t k, const at::Tensor& row_ids);

}  // namespace pagedserve_native
