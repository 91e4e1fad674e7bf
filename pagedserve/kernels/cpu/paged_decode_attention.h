// Paged decode attention cut into the pieces a caller's own parallel region runs (paged_attention.cpp).
//
// pagedserve::paged_decode_attention is: plan the call (this class's constructor: checks, work items), run every
// item (at::parallel_for over num_items()), then merge the requests with several partitions (at::parallel_for over
// num_merges()). kernels/cpu/decode_stack.cpp runs the same pieces inside the one parallel region of its decode
// step instead, so the two give the same bits: an item's and a merge's result never depend on which thread runs it
// or on the other items.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <optional>

namespace pagedserve_native {

class DecodeAttentionCall {
 public:
  // Checks the arguments as the op does (raises c10::Error) and plans the work items; `out` [num_decodes,
  // num_heads, head_dim] (contiguous, the query's dtype) receives the result.
  DecodeAttentionCall(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                      const at::Tensor& seq_lens, double scale, std::optional<int64_t> sliding_window,
                      int64_t partition_size, at::Tensor out);
  // The same for an int8 cache (the int8 view of byte pages) with its float32 scale view `kv_scales`
  // (paged_attention.cpp's header); kv_scales must be empty for a float32 / bfloat16 cache.
  DecodeAttentionCall(const at::Tensor& query, const at::Tensor& kv_cache, const std::optional<at::Tensor>& kv_scales,
                      const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                      std::optional<int64_t> sliding_window, int64_t partition_size, at::Tensor out);
  ~DecodeAttentionCall();
  DecodeAttentionCall(const DecodeAttentionCall&) = delete;
  DecodeAttentionCall& operator=(const DecodeAttentionCall&) = delete;

  int64_t num_items() const;
  int64_t num_merges() const;
  // Items [begin, end); disjoint ranges may run on different threads at once. A block id outside the cache raises.
  void run_items(int64_t begin, int64_t end) const;
  // The same items over another cache of the planned cache's sizes, dtype and layout (unchecked): the calls of
  // layers that differ only in their caches share one plan. Not for int8 caches (their scales are the plan's).
  void run_items_on(const at::Tensor& kv_cache, int64_t begin, int64_t end) const;
  // The same over another int8 cache and its scale view (an int8 plan: the layers of an int8 model share one plan).
  void run_items_on(const at::Tensor& kv_cache, const at::Tensor& kv_scales, int64_t begin, int64_t end) const;
  // Merges [begin, end), once every item has run; disjoint ranges may run at once.
  void merge(int64_t begin, int64_t end) const;

  struct State;

 private:
  std::unique_ptr<State> state_;
};

// One K or V row of head_dim contiguous values quantized into `destination` as reshape_and_cache_int8 does it (the
// same code): returns the row's scale (max|x| / 127, 0 for a zero row).
float quantize_int8_row(const float* source, int64_t head_dim, int8_t* destination);
float quantize_int8_row(const c10::BFloat16* source, int64_t head_dim, int8_t* destination);

}  // namespace pagedserve_native
