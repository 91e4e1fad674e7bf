// The decoder stack of a Llama-family model for one decode step, in one native call.
//
// Python side: models/native_decode_stack.py (which models and steps qualify, and the reference it must equal).
// A batch-1 decode step of a small model is ~120 weight streams of a few hundred microseconds each, and the
// ~40 module calls per layer that drive them in Python (nn.Module dispatch, attribute lookups, op dispatch)
// cost as much again. This op walks the layers in C++ and calls the very same kernels, in the same order and
// with the same arguments, through torch's dispatcher:
//   per layer: [add +] RMSNorm -> qkv linear -> split -> neox RoPE (q, k) -> K/V write -> paged decode attention
//              -> o linear -> add + RMSNorm -> gate_up linear -> SiLU-and-mul -> down linear
//   then the final add + RMSNorm.
// With int8 KV pages (DecodeStackPlan.set_kv_scales: each layer's scale view) the K/V write is
// reshape_and_cache_int8 and the attention paged_decode_attention_int8 (in one region: their row quantizer,
// quantize_int8_row, and DecodeAttentionCall over the int8 pages and that layer's scales).
// The results are therefore bitwise those of the module path (tests/models/test_native_decode_stack.py).
// It also looks the tokens up in the embedding table (at::embedding, as VocabParallelEmbedding on one rank) and
// range-checks the positions against the rotary table first (ValueError, as RotaryEmbedding.check_positions): each
// torch call from Python costs ~50-70 us of a decode step whose weight stream has evicted the code and objects it
// touches from every cache (Zen 4 VM), as much as a whole layer's small kernels here.
//
// Class and op:
//   DecodeStackPlan(weights (6 per layer: input norm, qkv, o, post-attention norm, gate_up, down), biases (4 per
//       layer: qkv, o, gate_up, down; None when the layer has none), kv_caches (one per layer, written), embedding
//       [V, H] (the token table), final_norm, cos_sin_cache, output_sizes (qkv, o, gate_up, down), sliding_windows
//       (one per layer, 0: none), num_heads, num_kv_heads, head_dim, eps, scale, linear_kind, reduction_lanes,
//       partition_size, one_region_max_rows): what does not change between steps, made once per plan;
//       num_one_region_steps() counts the steps that ran in one region
//   llama_decode_stack(plan, input_ids [M] int64, positions [M] int64, block_table [M, B] int32, seq_lens [M] int32,
//       slot_mapping [M] int64, max_positions (RotaryEmbedding.max_positions)) -> the final norm's output [M, H]
//   llama_decode_stack_greedy(the same arguments) -> the LM head's greedy pick of every row [M] int64 (empty, nothing
//       run, when the plan has no head or a float32 step would not take its one region): a greedy verification of
//       drafts, every token of the step a row (spec_decode/speculator.py verify_targets)
//   decode_rows_greedy(handle, rows, max_positions, allowed) -> token ids (the Python binding at the end of this file; the
//       plan by DecodeStackPlan.handle(), rows and tokens as lists): a decode step of rows `rows` of the runner's
//       persistent batch (DecodeStackPlan.bind_batch: worker/input_batch.py's arrays), its
//       inputs read from the batch and the LM head's greedy pick from the final norm's output (the head set by
//       DecodeStackPlan.set_greedy_head: amx_linear_first_argmax's in bfloat16, small_batch_linear's logits and
//       cpu_first_argmax's in float32) appended to it: the runner's whole greedy decode step in one call, the head
//       inside the step's one region (float32 steps only there: can_sample_greedy). The runner calls it when the
//       sampler would take nothing else (sample/fused_greedy_head.py is_plain_greedy). Empty when a row's next token
//       is not sampled (a one-token prefill chunk). `allowed` (None, or int32 [rows, words]: structured outputs' grammar
//       bitmask of each row, allowed_tokens.h) restricts each row's pick to its allowed tokens. A Python binding, not a torch op: it writes the batch, which a
//       schema could not say, and the dispatcher's call cost ~130 us of a batch-1 step (PlanRegistry).
//   linear_kind: 0 plain weights on at::linear, 1 plain float32 weights on small_batch_linear (M <= 16, else
//   at::linear), 2 tile-packed bfloat16 weights on amx_linear (AMX or AVX512-BF16), 3 oneDNN-packed weights on
//   mkldnn::_linear_pointwise (weight_layout='prepacked'), 4 as 1 up to 128 rows, with mkldnn::_linear_pointwise
//   on the plain weight above (small_batch_linear.py off Intel), 5 GGUF blocks kept quantized (float32 models;
//   layers/gguf_linear.py: gguf_linear up to 8 rows (every M where its amx unit takes the type), the dequantized
//   weight on at::linear above; the block types
//   of the linears, the embedding table and the head by DecodeStackPlan.set_gguf_types, and a fused linear whose
//   parts hold different types as parts of one flat weight by set_gguf_parts), 6 W8A8 int8 weights on
//   w8a8_linear (float32 or bfloat16 models; layers/quantization/w8a8_int8.py: every M, its product unit chosen per
//   call as the op chooses it ('auto': AMX-INT8, AVX512-VNNI or int16); the scales by
//   DecodeStackPlan.set_w8a8_scales). Every M row is one decoding request.
// Steps on kinds 2 (bfloat16), 6 (either dtype) and 1 / 4 / 5 (float32, while small_batch_linear or gguf_linear takes
// the rows) of up to one_region_max_rows rows run every layer inside one parallel region (run_layers_in_one_region);
// the others run op by op, each op with its own (run_layers_op_by_op).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <omp.h>
#include <torch/custom_class.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "paged_decode_attention.h"
#include "amx_linear.h"
#include "elementwise.h"
#include "small_batch_linear.h"
#include "allowed_tokens.h"
#include "first_argmax.h"
#include "gguf_linear.h"
#include "int8_linear.h"
#include "spin_barrier.h"

namespace {

constexpr int64_t kWeightsPerLayer = 6;
constexpr int64_t kBiasesPerLayer = 4;
constexpr int64_t kLinearSlots[kBiasesPerLayer] = {1, 2, 4, 5};  // qkv, o, gate_up, down in a layer's weights
// layers/small_batch_linear.py native_max_rows(): kind 1 (Intel, MKL above) and kind 4 (elsewhere, oneDNN above).
constexpr int64_t kSmallBatchMaxRows = 16;        // INTEL_MAX_ROWS
constexpr int64_t kSmallBatchOneDnnMaxRows = 128;  // MAX_ROWS
// layers/gguf_linear.py KERNEL_MAX_ROWS: kind 5 runs gguf_linear up to this many rows, the dequantized weight above
// (every row count of a type the kernel's amx unit takes, where it runs: gguf_amx_takes, runs_on_kernel in Python).
constexpr int64_t kGgufKernelMaxRows = 8;

enum LinearKind : int64_t {
  kPlain = 0,
  kSmallBatch = 1,
  kAmxPacked = 2,
  kOneDnnPacked = 3,
  kSmallBatchOneDnn = 4,
  kGguf = 5,
  kW8A8 = 6,
};

using Pair = std::tuple<at::Tensor, at::Tensor>;
using OptionalTensor = std::optional<at::Tensor>;

// The kernels this op drives, looked up once in the dispatcher (they live in the same library).
struct Kernels {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double, int64_t)> rms_norm;
  c10::TypedOperatorHandle<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t)>
      add_rms_norm;
  c10::TypedOperatorHandle<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>
      rotary_embedding;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_and_mul;
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, at::Tensor&, const at::Tensor&)>
      reshape_and_cache;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      double, std::optional<int64_t>, int64_t)>
      decode_attention;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&, int64_t,
                                      c10::string_view)>
      amx_linear;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&)> small_batch_linear;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&, int64_t, int64_t,
                                      c10::string_view, const OptionalTensor&)>
      first_argmax;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptionalTensor&,
                                      c10::string_view)>
      gguf_linear;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, int64_t, int64_t)> gguf_dequantize;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, int64_t, int64_t, const at::Tensor&)> gguf_embedding;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptionalTensor&,
                                      const OptionalTensor&, std::optional<at::ScalarType>, c10::string_view)>
      w8a8_linear;
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&)>
      reshape_and_cache_int8;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, double, std::optional<int64_t>, int64_t)>
      decode_attention_int8;

  static const Kernels& get() {
    static const Kernels kernels = [] {
      auto& dispatcher = c10::Dispatcher::singleton();
      const auto find = [&](const char* name) { return dispatcher.findSchemaOrThrow(name, ""); };
      return Kernels{
          find("pagedserve::cpu_rms_norm").typed<at::Tensor(const at::Tensor&, const at::Tensor&, double, int64_t)>(),
          find("pagedserve::cpu_add_rms_norm")
              .typed<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t)>(),
          find("pagedserve::cpu_rotary_embedding")
              .typed<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>(),
          find("pagedserve::cpu_silu_and_mul").typed<at::Tensor(const at::Tensor&)>(),
          find("pagedserve::reshape_and_cache")
              .typed<void(const at::Tensor&, const at::Tensor&, at::Tensor&, const at::Tensor&)>(),
          find("pagedserve::paged_decode_attention")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                std::optional<int64_t>, int64_t)>(),
          find("pagedserve::amx_linear")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&, int64_t,
                                c10::string_view)>(),
          find("pagedserve::small_batch_linear")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&)>(),
          find("pagedserve::amx_linear_first_argmax")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&, int64_t, int64_t,
                                c10::string_view, const OptionalTensor&)>(),
          find("pagedserve::gguf_linear")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptionalTensor&,
                                c10::string_view)>(),
          find("pagedserve::gguf_dequantize").typed<at::Tensor(const at::Tensor&, int64_t, int64_t)>(),
          find("pagedserve::gguf_embedding")
              .typed<at::Tensor(const at::Tensor&, int64_t, int64_t, const at::Tensor&)>(),
          find("pagedserve::w8a8_linear")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptionalTensor&,
                                const OptionalTensor&, std::optional<at::ScalarType>, c10::string_view)>(),
          find("pagedserve::reshape_and_cache_int8")
              .typed<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&)>(),
          find("pagedserve::paged_decode_attention_int8")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, double, std::optional<int64_t>, int64_t)>(),
      };
    }();
    return kernels;
  }
};

using OneDnnLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&, c10::string_view,
                                c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>);

// oneDNN's packed GEMM (layers/prepacked_matmul.py), looked up at its first use: a torch built without oneDNN
// lacks the op, and the other kinds must not need it.
const c10::TypedOperatorHandle<OneDnnLinear>& onednn_linear() {
  static const auto handle =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<OneDnnLinear>();
  return handle;
}

// What the linear layers' methods run (layers/linear.py UnquantizedLinearMethod, small_batch_linear.py,
// amx_linear.py, weight_layout.py OneDnnPrepackedLinearMethod, gguf_linear.py GGUFLinearMethod, w8a8_int8.py
// W8A8Int8LinearMethod), for a contiguous 2-D x; `quantization` holds the weight's block type (kind 5) or its scales
// (kind 6).
// One part of a fused GGUF linear whose parts hold different block types (layers/gguf_linear.py GGUFPart): output
// columns [column, column + num_columns), num_columns rows of row_bytes bytes at byte_offset of the flat weight.
struct GgufPart {
  int64_t column, num_columns, byte_offset, row_bytes, ggml_type;

  at::Tensor blocks(const at::Tensor& weight) const {
    return weight.narrow(0, byte_offset, num_columns * row_bytes).view({num_columns, row_bytes});
  }
  OptionalTensor bias(const OptionalTensor& bias) const {
    return bias.has_value() ? OptionalTensor(bias->narrow(0, column, num_columns)) : OptionalTensor();
  }
};

struct LinearQuantization {
  int64_t ggml_type = 0;
  const std::vector<GgufPart>* gguf_parts = nullptr;  // kind 5's fused linear of mixed types (else one type)
  const at::Tensor* weight_scale = nullptr;
  const OptionalTensor* input_scale = nullptr;
};

at::Tensor linear(const Kernels& kernels, int64_t kind, const at::Tensor& x, const at::Tensor& weight,
                  const OptionalTensor& bias, int64_t output_size, const LinearQuantization& quantization) {
  if (kind == kW8A8)
    return kernels.w8a8_linear.call(x, weight, *quantization.weight_scale, *quantization.input_scale, bias,
                                    std::nullopt, "auto");
  const int64_t ggml_type = quantization.ggml_type;
  if (kind == kGguf) {
    const auto product = [&](const at::Tensor& blocks, int64_t type, const OptionalTensor& part_bias) {
      if (x.size(0) <= kGgufKernelMaxRows || pagedserve_native::gguf_amx_takes(type))
        return kernels.gguf_linear.call(x, blocks, type, part_bias, "auto");
      return at::linear(x, kernels.gguf_dequantize.call(blocks, type, x.size(1)), part_bias);
    };
    if (quantization.gguf_parts == nullptr) return product(weight, ggml_type, bias);
    std::vector<at::Tensor> outputs;  // as GGUFPartsLinearMethod: each part's product, concatenated
    for (const GgufPart& part : *quantization.gguf_parts)
      outputs.push_back(product(part.blocks(weight), part.ggml_type, part.bias(bias)));
    return at::cat(outputs, 1);
  }
  if (kind == kAmxPacked) return kernels.amx_linear.call(x, weight, bias, output_size, "auto");
  const bool is_small_batch = (kind == kSmallBatch && x.size(0) <= kSmallBatchMaxRows) ||
                              (kind == kSmallBatchOneDnn && x.size(0) <= kSmallBatchOneDnnMaxRows);
  if (is_small_batch) return kernels.small_batch_linear.call(x, weight, bias);
  if (kind == kOneDnnPacked || kind == kSmallBatchOneDnn)
    return onednn_linear().call(x, weight, bias, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
  return at::linear(x, weight, bias);
}

struct DecodeStackPlan;

// Plans by integer handle, for the Python binding (decode_rows_greedy below): on the Zen 4 VM a call through torch's
// dispatcher with the plan as a TorchBind argument, from cold caches after a batch-1 step's weight stream, cost
// ~130 us more than the step itself. A plan registers itself at its first handle() and leaves at its destruction.
struct PlanRegistry {
  std::mutex mutex;
  std::unordered_map<int64_t, DecodeStackPlan*> plans;
  int64_t next_handle = 1;

  static PlanRegistry& get() {
    static PlanRegistry registry;
    return registry;
  }
};

// What llama_decode_stack reads that does not change between steps, handed over once (Python: the plan's
// `native` object). Passing the ~180 weights, ~120 biases and 30 KV caches as op arguments instead cost ~180 us of
// every batch-1 decode step on the Zen 4 VM: boxing each tensor touches its TensorImpl, which the step's weight
// stream has evicted from every cache.
struct DecodeStackPlan : torch::CustomClassHolder {
  std::vector<at::Tensor> weights;  // 6 per layer: input norm, qkv, o, post-attention norm, gate_up, down
  std::vector<OptionalTensor> biases;  // 4 per layer: qkv, o, gate_up, down
  std::vector<at::Tensor> kv_caches;  // one per layer, written
  // int8 caches (kv_cache_dtype="int8"): each layer's float32 scale view [2, num_blocks, block_size, num_kv_heads]
  // of the same pages (set_kv_scales; empty: caches of the model's dtype).
  std::vector<at::Tensor> kv_scales;
  at::Tensor embedding, final_norm, cos_sin_cache;
  std::vector<int64_t> output_sizes, sliding_windows;
  int64_t num_heads, num_kv_heads, head_dim;
  double eps, scale;
  int64_t linear_kind, reduction_lanes, partition_size;
  // Steps of up to this many rows run the layers in one parallel region (run_layers_in_one_region; 0: never) when
  // the plan's kind and tensors allow it (one_region_rows_limit).
  int64_t one_region_max_rows;
  int64_t num_one_region_steps = 0;  // steps that ran in one region (tests read it)
  // Whether the plan's tensors are what run_layers_in_one_region reads without checking (set by the constructor).
  bool is_one_region_capable = false;
  // The LM head decode_rows_greedy samples from (set_greedy_head; undefined: none): tile-packed bfloat16
  // weights as amx_linear_first_argmax takes them (kind 2), or plain float32 ones as small_batch_linear does.
  at::Tensor head_weight;
  OptionalTensor head_bias;
  int64_t head_output_size = 0, head_num_columns = 0;
  // Kind 5: the block types of the linears (4 per layer: qkv, o, gate_up, down), of the embedding table and of the
  // head (set_gguf_types; 0: a float table or head).
  std::vector<int64_t> weight_types;
  int64_t embedding_type = 0, head_type = 0;
  // Kind 5: the parts of each linear (4 per layer) whose parts hold different types, its weight then a flat uint8
  // tensor (set_gguf_parts; empty: every linear one type, or this linear).
  std::vector<std::vector<GgufPart>> linear_parts;
  // Kind 5: the most rows gguf_linear takes for every linear and the head (set_gguf_types): any number where its amx
  // unit takes every type, else its vector products' kGgufKernelMaxRows.
  int64_t gguf_kernel_rows = kGgufKernelMaxRows;
  // Kind 6: the linears' float32 weight scales [N] and static input scales (none: per-token), 4 per layer
  // (set_w8a8_scales).
  std::vector<at::Tensor> weight_scales;
  std::vector<OptionalTensor> input_scales;
  // The runner's persistent batch (bind_batch; undefined: none): token ids [R, L] int64, token counts [R] int64,
  // computed-token counts [R] int64, block table [R, B] int32 and its filled columns [R] int64, numpy's memory.
  at::Tensor batch_token_ids, batch_num_tokens, batch_num_computed_tokens, batch_block_table, batch_num_blocks;

  DecodeStackPlan(std::vector<at::Tensor> weights_, c10::List<OptionalTensor> biases_,
                  std::vector<at::Tensor> kv_caches_, at::Tensor embedding_, at::Tensor final_norm_,
                  at::Tensor cos_sin_cache_, std::vector<int64_t> output_sizes_, std::vector<int64_t> sliding_windows_,
                  int64_t num_heads_, int64_t num_kv_heads_, int64_t head_dim_, double eps_, double scale_,
                  int64_t linear_kind_, int64_t reduction_lanes_, int64_t partition_size_,
                  int64_t one_region_max_rows_)
      : weights(std::move(weights_)),
        kv_caches(std::move(kv_caches_)),
        embedding(std::move(embedding_)),
        final_norm(std::move(final_norm_)),
        cos_sin_cache(std::move(cos_sin_cache_)),
        output_sizes(std::move(output_sizes_)),
        sliding_windows(std::move(sliding_windows_)),
        num_heads(num_heads_),
        num_kv_heads(num_kv_heads_),
        head_dim(head_dim_),
        eps(eps_),
        scale(scale_),
        linear_kind(linear_kind_),
        reduction_lanes(reduction_lanes_),
        partition_size(partition_size_),
        one_region_max_rows(one_region_max_rows_) {
    for (const OptionalTensor& bias : biases_) biases.push_back(bias);
    const int64_t num_layers = static_cast<int64_t>(kv_caches.size());
    TORCH_CHECK(num_layers >= 1, "DecodeStackPlan: at least one layer expected");
    TORCH_CHECK(static_cast<int64_t>(weights.size()) == kWeightsPerLayer * num_layers,
                "DecodeStackPlan: ", kWeightsPerLayer * num_layers, " weights expected for ", num_layers,
                " layers, got ", weights.size());
    TORCH_CHECK(static_cast<int64_t>(biases.size()) == kBiasesPerLayer * num_layers,
                "DecodeStackPlan: ", kBiasesPerLayer * num_layers, " biases expected, got ", biases.size());
    TORCH_CHECK(static_cast<int64_t>(sliding_windows.size()) == num_layers,
                "DecodeStackPlan: one sliding window per layer expected, got ", sliding_windows.size());
    TORCH_CHECK(output_sizes.size() == 4, "DecodeStackPlan: 4 output sizes (qkv, o, gate_up, down) expected");
    TORCH_CHECK(linear_kind >= kPlain && linear_kind <= kW8A8, "DecodeStackPlan: linear_kind=", linear_kind,
                " must be 0, 1, 2, 3, 4, 5 or 6");
    is_one_region_capable = one_region_capable();
  }

  // The hidden size (a GGUF embedding table's columns are bytes).
  int64_t hidden_size() const { return final_norm.numel(); }

  // Kind 5's block types (see the fields): checked against the weights' bytes per row.
  void set_gguf_types(std::vector<int64_t> linear_types, int64_t embedding_type_, int64_t head_type_) {
    TORCH_CHECK(linear_kind == kGguf, "DecodeStackPlan.set_gguf_types: the plan's linear_kind is ", linear_kind);
    const int64_t num_layers = static_cast<int64_t>(kv_caches.size());
    TORCH_CHECK(static_cast<int64_t>(linear_types.size()) == kBiasesPerLayer * num_layers,
                "DecodeStackPlan.set_gguf_types: ", kBiasesPerLayer * num_layers, " linear types expected, got ",
                linear_types.size());
    for (int64_t layer = 0; layer < num_layers; ++layer)
      for (int64_t part = 0; part < kBiasesPerLayer; ++part) {
        if (has_parts(layer * kBiasesPerLayer + part)) continue;  // set_gguf_parts checked them
        const at::Tensor& weight = weights[layer * kWeightsPerLayer + kLinearSlots[part]];
        const int64_t type = linear_types[layer * kBiasesPerLayer + part];
        const pagedserve_native::GgmlBlockFormat format = pagedserve_native::ggml_block_format(type);
        TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous() &&
                        weight.size(1) % format.bytes == 0,
                    "DecodeStackPlan.set_gguf_types: layer ", layer, " linear ", part, " holds no type ", type,
                    " blocks");
      }
    weight_types = std::move(linear_types);
    embedding_type = embedding_type_;
    head_type = head_type_;
    bool is_every_type_on_amx = head_type == 0 || pagedserve_native::gguf_amx_takes(head_type);
    for (size_t index = 0; index < weight_types.size(); ++index) {
      if (has_parts(static_cast<int64_t>(index))) {
        for (const GgufPart& part : linear_parts[index])
          is_every_type_on_amx &= pagedserve_native::gguf_amx_takes(part.ggml_type);
      } else {
        is_every_type_on_amx &= pagedserve_native::gguf_amx_takes(weight_types[index]);
      }
    }
    gguf_kernel_rows = is_every_type_on_amx ? std::numeric_limits<int64_t>::max() : kGgufKernelMaxRows;
    is_one_region_capable = one_region_capable();
  }

  bool has_parts(int64_t linear) const {
    return !linear_parts.empty() && !linear_parts[linear].empty();
  }

  // Kind 5's fused linears of mixed block types, before set_gguf_types: per linear (4 per layer) an int64 [P, 5]
  // tensor of (column, columns, byte offset, bytes per row, ggml type) rows in column order, or [0, 5] for a linear
  // of one type. A linear with parts holds a flat uint8 weight that the parts fill exactly.
  void set_gguf_parts(std::vector<at::Tensor> parts) {
    TORCH_CHECK(linear_kind == kGguf, "DecodeStackPlan.set_gguf_parts: the plan's linear_kind is ", linear_kind);
    const int64_t num_layers = static_cast<int64_t>(kv_caches.size());
    TORCH_CHECK(static_cast<int64_t>(parts.size()) == kBiasesPerLayer * num_layers, "DecodeStackPlan.set_gguf_parts: ",
                kBiasesPerLayer * num_layers, " part tables expected, got ", parts.size());
    const int64_t input_sizes[kBiasesPerLayer] = {hidden_size(), num_heads * head_dim, hidden_size(),
                                                  output_sizes[2] / 2};
    std::vector<std::vector<GgufPart>> tables(parts.size());
    for (size_t index = 0; index < parts.size(); ++index) {
      const at::Tensor& table = parts[index];
      TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(1) == 5,
                  "DecodeStackPlan.set_gguf_parts: linear ", index, ": an int64 [P, 5] table expected");
      const at::Tensor rows = table.contiguous();
      const int64_t* values = rows.data_ptr<int64_t>();
      const int64_t part = static_cast<int64_t>(index) % kBiasesPerLayer;
      const at::Tensor& weight = weights[(static_cast<int64_t>(index) / kBiasesPerLayer) * kWeightsPerLayer +
                                         kLinearSlots[part]];
      int64_t column = 0, num_bytes = 0;
      for (int64_t row = 0; row < rows.size(0); ++row) {
        const GgufPart entry{values[5 * row], values[5 * row + 1], values[5 * row + 2], values[5 * row + 3],
                             values[5 * row + 4]};
        const pagedserve_native::GgmlBlockFormat format = pagedserve_native::ggml_block_format(entry.ggml_type);
        TORCH_CHECK(entry.column == column && entry.byte_offset == num_bytes && entry.num_columns > 0 &&
                        input_sizes[part] % format.values == 0 &&
                        entry.row_bytes == input_sizes[part] / format.values * format.bytes,
                    "DecodeStackPlan.set_gguf_parts: linear ", index, " part ", row, " does not follow the one before ",
                    "it or holds no type ", entry.ggml_type, " rows of ", input_sizes[part], " values");
        column += entry.num_columns;
        num_bytes += entry.num_columns * entry.row_bytes;
        tables[index].push_back(entry);
      }
      TORCH_CHECK(rows.size(0) == 0 || (column == output_sizes[part] && weight.scalar_type() == at::kByte &&
                                        weight.dim() == 1 && weight.is_contiguous() && weight.numel() == num_bytes),
                  "DecodeStackPlan.set_gguf_parts: linear ", index, "'s parts do not fill its ", output_sizes[part],
                  " columns and flat uint8 weight");
    }
    linear_parts = std::move(tables);
  }

  // Kind 6's scales (see the fields): one float32 weight scale per weight row, a static input scale one value.
  void set_w8a8_scales(std::vector<at::Tensor> weight_scales_, c10::List<OptionalTensor> input_scales_) {
    TORCH_CHECK(linear_kind == kW8A8, "DecodeStackPlan.set_w8a8_scales: the plan's linear_kind is ", linear_kind);
    const int64_t num_layers = static_cast<int64_t>(kv_caches.size());
    TORCH_CHECK(static_cast<int64_t>(weight_scales_.size()) == kBiasesPerLayer * num_layers &&
                    static_cast<int64_t>(input_scales_.size()) == kBiasesPerLayer * num_layers,
                "DecodeStackPlan.set_w8a8_scales: ", kBiasesPerLayer * num_layers,
                " weight scales and input scales expected, got ", weight_scales_.size(), " and ",
                input_scales_.size());
    const int64_t slots[kBiasesPerLayer] = {1, 2, 4, 5};  // qkv, o, gate_up, down in a layer's weights
    std::vector<OptionalTensor> inputs;
    for (int64_t layer = 0; layer < num_layers; ++layer)
      for (int64_t part = 0; part < kBiasesPerLayer; ++part) {
        const int64_t index = layer * kBiasesPerLayer + part;
        const at::Tensor& weight = weights[layer * kWeightsPerLayer + slots[part]];
        const at::Tensor& scale = weight_scales_[index];
        const OptionalTensor input_scale = input_scales_.get(index);
        TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous() &&
                        scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == weight.size(0) &&
                        (!input_scale.has_value() || input_scale->numel() == 1),
                    "DecodeStackPlan.set_w8a8_scales: layer ", layer, " linear ", part,
                    " needs an int8 weight [N, K], N float32 weight scales and at most one input scale");
        inputs.push_back(input_scale);
      }
    weight_scales = std::move(weight_scales_);
    input_scales = std::move(inputs);
    is_one_region_capable = one_region_capable();
  }

  // int8 KV caches: each layer's scale view (kv_quantization.kv_cache_scales of its cache), written with the cache.
  void set_kv_scales(std::vector<at::Tensor> scales) {
    TORCH_CHECK(scales.size() == kv_caches.size(), "DecodeStackPlan.set_kv_scales: one scale view per layer (",
                kv_caches.size(), ") expected, got ", scales.size());
    for (size_t layer = 0; layer < kv_caches.size(); ++layer) {
      const at::Tensor& cache = kv_caches[layer];
      const at::Tensor& layer_scales = scales[layer];
      TORCH_CHECK(cache.scalar_type() == at::kChar && cache.dim() == 5 && cache.stride(4) == 1 &&
                      cache.stride(3) == cache.size(4) && cache.stride(2) == cache.size(3) * cache.size(4) &&
                      cache.strides() == kv_caches[0].strides(),
                  "DecodeStackPlan.set_kv_scales: layer ", layer, "'s KV cache is not an int8 page view like layer 0's");
      TORCH_CHECK(layer_scales.scalar_type() == at::kFloat && layer_scales.dim() == 4 &&
                      layer_scales.sizes() == cache.sizes().slice(0, 4) && layer_scales.stride(3) == 1 &&
                      layer_scales.strides() == scales[0].strides(),
                  "DecodeStackPlan.set_kv_scales: layer ", layer, "'s scales must be a float32 [2, num_blocks, "
                  "block_size, num_kv_heads] view like layer 0's, got ", layer_scales.sizes());
    }
    kv_scales = std::move(scales);
    is_one_region_capable = one_region_capable();
  }

  bool is_int8_cache() const { return !kv_scales.empty(); }

  // The block type (kind 5) or scales (kind 6) of layer `layer`'s linear `part` (qkv, o, gate_up, down).
  LinearQuantization quantization_of(int64_t layer, int64_t part) const {
    const int64_t index = layer * kBiasesPerLayer + part;
    LinearQuantization quantization;
    if (!weight_types.empty()) quantization.ggml_type = weight_types[index];
    if (has_parts(index)) quantization.gguf_parts = &linear_parts[index];
    if (!weight_scales.empty()) {
      quantization.weight_scale = &weight_scales[index];
      quantization.input_scale = &input_scales[index];
    }
    return quantization;
  }

  // The region's dtype: bfloat16 on tile-packed weights and in a bfloat16 W8A8 model, float32 otherwise.
  bool is_bfloat16_region() const {
    return linear_kind == kAmxPacked || (linear_kind == kW8A8 && final_norm.scalar_type() == at::kBFloat16);
  }

  // The rows a step may have to run in one region: tile-packed bfloat16 weights (amx_linear) or plain float32
  // weights on small_batch_linear, where that kernel takes the step (0: never).
  int64_t one_region_rows_limit() const {
    if (!is_one_region_capable) return 0;
    if (linear_kind == kAmxPacked || linear_kind == kW8A8) return one_region_max_rows;
    if (linear_kind == kGguf) return std::min(one_region_max_rows, gguf_kernel_rows);
    return std::min(one_region_max_rows, linear_kind == kSmallBatch ? kSmallBatchMaxRows : kSmallBatchOneDnnMaxRows);
  }

  // Weights on amx_linear (bfloat16) or small_batch_linear (float32), and an embedding, norms and KV caches of that
  // dtype laid out as run_layers_in_one_region reads them (the op-by-op path checks the same through its ops at
  // every call).
  bool one_region_capable() const {
    const at::ScalarType dtype = is_bfloat16_region() ? at::kBFloat16 : at::kFloat;
    const auto is_of_dtype = [dtype](const at::Tensor& tensor) {
      return tensor.scalar_type() == dtype && tensor.is_contiguous() && tensor.device().is_cpu();
    };
    const bool is_kernel_kind = linear_kind == kAmxPacked || linear_kind == kSmallBatch ||
                                linear_kind == kSmallBatchOneDnn || linear_kind == kGguf || linear_kind == kW8A8;
    if (linear_kind == kGguf && weight_types.empty()) return false;  // set_gguf_types not called yet
    if (linear_kind == kW8A8 && weight_scales.empty()) return false;  // set_w8a8_scales not called yet
    const bool is_table_of_rows = embedding_type != 0
                                      ? embedding.scalar_type() == at::kByte && embedding.is_contiguous()
                                      : is_of_dtype(embedding);
    if (!is_kernel_kind || !is_table_of_rows || embedding.dim() != 2 || head_dim % 2 != 0) return false;
    const int64_t hidden = hidden_size();
    if (output_sizes[0] != (num_heads + 2 * num_kv_heads) * head_dim || output_sizes[1] != hidden ||
        output_sizes[2] % 2 != 0 || output_sizes[3] != hidden)
      return false;
    if (!is_of_dtype(final_norm) || final_norm.numel() != hidden) return false;
    if (cos_sin_cache.scalar_type() != at::kFloat || !cos_sin_cache.is_contiguous() || cos_sin_cache.dim() != 2 ||
        cos_sin_cache.size(1) != head_dim)
      return false;
    for (size_t layer = 0; layer < kv_caches.size(); ++layer) {
      const at::Tensor& cache = kv_caches[layer];
      // int8 pages: set_kv_scales checked their layout.
      const bool is_cache_readable = is_int8_cache() ? cache.scalar_type() == at::kChar : is_of_dtype(cache);
      if (!is_cache_readable || cache.dim() != 5 || cache.size(0) != 2 || cache.size(3) != num_kv_heads ||
          cache.size(4) != head_dim || cache.sizes() != kv_caches[0].sizes())
        return false;
      for (const int64_t norm : {int64_t{0}, int64_t{3}}) {
        const at::Tensor& weight = weights[layer * kWeightsPerLayer + norm];
        if (!is_of_dtype(weight) || weight.numel() != hidden) return false;
      }
    }
    return true;
  }

  // The LM head of decode_rows_greedy (checked at each step by amx_linear_first_argmax's own checks).
  void set_greedy_head(at::Tensor weight, OptionalTensor bias, int64_t output_size, int64_t num_columns) {
    TORCH_CHECK(weight.defined() && num_columns >= 1 && num_columns <= output_size,
                "DecodeStackPlan.set_greedy_head: a head weight and 1 <= num_columns <= output_size expected, got ",
                num_columns, " and ", output_size);
    head_weight = std::move(weight);
    head_bias = std::move(bias);
    head_output_size = output_size;
    head_num_columns = num_columns;
  }

  int64_t registered_handle = 0;  // handle() (0: none yet)

  ~DecodeStackPlan() override {
    if (registered_handle == 0) return;
    PlanRegistry& registry = PlanRegistry::get();
    const std::lock_guard<std::mutex> lock(registry.mutex);
    registry.plans.erase(registered_handle);
  }

  // The plan's handle for the Python binding, registered at the first call. The caller keeps the plan alive while it
  // uses the handle (a handle of a destroyed plan is refused).
  int64_t handle() {
    if (registered_handle == 0) {
      PlanRegistry& registry = PlanRegistry::get();
      const std::lock_guard<std::mutex> lock(registry.mutex);
      registered_handle = registry.next_handle++;
      registry.plans[registered_handle] = this;
    }
    return registered_handle;
  }

  // Whether decode_rows_greedy can sample a step of `num_rows` rows: with a head, a float32 one only in the
  // one region (its small-batch kernel and the argmax run there).
  bool can_sample_greedy(int64_t num_rows) const {
    return head_weight.defined() && (is_bfloat16_region() || num_rows <= one_region_rows_limit());
  }

  // The persistent batch decode_rows_greedy reads and appends to (shared memory: the arrays live as long as
  // the plan holds them).
  void bind_batch(at::Tensor token_ids, at::Tensor num_tokens, at::Tensor num_computed_tokens, at::Tensor block_table,
                  at::Tensor num_blocks) {
    const auto is_rows = [&](const at::Tensor& tensor, at::ScalarType dtype, int64_t dim) {
      return tensor.scalar_type() == dtype && tensor.dim() == dim && tensor.is_contiguous() &&
             tensor.device().is_cpu() && tensor.size(0) == token_ids.size(0);
    };
    TORCH_CHECK(is_rows(token_ids, at::kLong, 2) && is_rows(num_tokens, at::kLong, 1) &&
                    is_rows(num_computed_tokens, at::kLong, 1) && is_rows(block_table, at::kInt, 2) &&
                    is_rows(num_blocks, at::kLong, 1),
                "DecodeStackPlan.bind_batch: contiguous token_ids [R, L] int64, num_tokens, num_computed_tokens [R] "
                "int64, block_table [R, B] int32 and num_blocks [R] int64 expected");
    batch_token_ids = std::move(token_ids);
    batch_num_tokens = std::move(num_tokens);
    batch_num_computed_tokens = std::move(num_computed_tokens);
    batch_block_table = std::move(block_table);
    batch_num_blocks = std::move(num_blocks);
  }
};

// A layer's sliding window (None: the whole context).
std::optional<int64_t> sliding_window(const DecodeStackPlan& plan, int64_t layer) {
  const int64_t window = plan.sliding_windows[layer];
  return window > 0 ? std::optional<int64_t>(window) : std::nullopt;
}

// The step's inputs, checked (llama_decode_stack).
struct StepInputs {
  const at::Tensor& input_ids;
  const at::Tensor& positions;
  const at::Tensor& block_table;
  const at::Tensor& seq_lens;
  const at::Tensor& slot_mapping;
  // Greedy steps under structured outputs: int32 [M, words], each row's allowed tokens (allowed_tokens.h).
  OptionalTensor allowed_tokens = c10::nullopt;
};

// The layers one op at a time, each op with its own parallel region (any linear kind, any number of rows).
at::Tensor run_layers_op_by_op(const DecodeStackPlan& plan, const Kernels& kernels, const StepInputs& step) {
  const int64_t num_layers = static_cast<int64_t>(plan.kv_caches.size());
  const int64_t num_heads = plan.num_heads, num_kv_heads = plan.num_kv_heads, head_dim = plan.head_dim;
  const int64_t num_tokens = step.input_ids.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const std::vector<int64_t> split_sizes{q_size, kv_size, kv_size};

  at::Tensor states = plan.embedding_type != 0 ? kernels.gguf_embedding.call(plan.embedding, plan.embedding_type,
                                                                            plan.hidden_size(), step.input_ids)
                                               : at::embedding(plan.embedding, step.input_ids);
  at::Tensor residual, normed;
  const auto quantization_of = [&plan](int64_t layer, int64_t part) { return plan.quantization_of(layer, part); };
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const at::Tensor* w = plan.weights.data() + layer * kWeightsPerLayer;
    const OptionalTensor* layer_biases = plan.biases.data() + layer * kBiasesPerLayer;
    // LlamaDecoderLayer.forward: the first layer's residual is the embeddings; later ones fuse the add.
    if (layer == 0) {
      residual = states;
      normed = kernels.rms_norm.call(states, w[0], plan.eps, plan.reduction_lanes);
    } else {
      std::tie(normed, residual) = kernels.add_rms_norm.call(states, residual, w[0], plan.eps, plan.reduction_lanes);
    }
    // LlamaAttention.forward.
    const at::Tensor qkv =
        linear(kernels, plan.linear_kind, normed, w[1], layer_biases[0], plan.output_sizes[0], quantization_of(layer, 0));
    const std::vector<at::Tensor> parts = qkv.split_with_sizes(split_sizes, -1);
    at::Tensor query, key;
    std::tie(query, key) =
        kernels.rotary_embedding.call(step.positions, parts[0], parts[1], plan.cos_sin_cache, head_dim);
    // Attention.forward and CpuNativeAttentionBackend's decode-only path.
    query = query.view({num_tokens, num_heads, head_dim});
    key = key.view({num_tokens, num_kv_heads, head_dim});
    const at::Tensor value = parts[2].view({num_tokens, num_kv_heads, head_dim});
    at::Tensor kv_cache = plan.kv_caches[layer];
    at::Tensor attended;
    if (plan.is_int8_cache()) {
      at::Tensor kv_scales = plan.kv_scales[layer];
      kernels.reshape_and_cache_int8.call(key, value, kv_cache, kv_scales, step.slot_mapping);
      attended = kernels.decode_attention_int8.call(query, kv_cache, kv_scales, step.block_table, step.seq_lens,
                                                    plan.scale, sliding_window(plan, layer), plan.partition_size);
    } else {
      kernels.reshape_and_cache.call(key, value, kv_cache, step.slot_mapping);
      attended = kernels.decode_attention.call(query, kv_cache, step.block_table, step.seq_lens, plan.scale,
                                               sliding_window(plan, layer), plan.partition_size);
    }
    attended = attended.reshape({num_tokens, q_size});
    const at::Tensor projected =
        linear(kernels, plan.linear_kind, attended, w[2], layer_biases[1], plan.output_sizes[1], quantization_of(layer, 1));
    // The post-attention norm and LlamaMLP.
    std::tie(normed, residual) = kernels.add_rms_norm.call(projected, residual, w[3], plan.eps, plan.reduction_lanes);
    const at::Tensor gate_up =
        linear(kernels, plan.linear_kind, normed, w[4], layer_biases[2], plan.output_sizes[2], quantization_of(layer, 2));
    states = linear(kernels, plan.linear_kind, kernels.silu_and_mul.call(gate_up), w[5], layer_biases[3],
                    plan.output_sizes[3], quantization_of(layer, 3));
  }
  return std::get<0>(kernels.add_rms_norm.call(states, residual, plan.final_norm, plan.eps, plan.reduction_lanes));
}

// Thread `thread` of `num_threads`' share of `count` work units: the split at::parallel_for(0, count, 1) makes.
std::pair<int64_t, int64_t> thread_share(int64_t count, int64_t thread, int64_t num_threads) {
  const int64_t chunk = (count + num_threads - 1) / num_threads;
  const int64_t begin = std::min(count, thread * chunk);
  return {begin, std::min(count, begin + chunk)};
}

// The layers in one parallel region (scalar_t bfloat16 on amx_linear, float32 on small_batch_linear; up to
// DecodeStackPlan::one_region_rows_limit() rows): the same arithmetic as run_layers_op_by_op, so the same bits, with
// two differences in how it is driven.
// - The threads meet at a SpinBarrier between the stages instead of starting and joining a team for each op (a
//   batch-1 step of SmolLM2-135M started ~150). The products and the attention items are split between the
//   threads into the units their ops split (AmxLinearCall, SmallBatchLinearCall, DecodeAttentionCall).
// - The row stages between them (norms, RoPE with the K/V write, SiLU) run on the ops' row kernels (elementwise.h)
//   over buffers made before the region, each row on one thread as in the ops: no tensor is made and no op
//   dispatched inside the region. The embedding row and the K/V rows are copied as at::embedding and
//   reshape_and_cache copy them (same dtype: the bytes).
// Batch-1 decode on the Zen 4 VM, alternating with op by op in one process (median of six rounds): bfloat16 1.059x
// with the row stages still dispatched as ops on thread 0, 1.094x with the row kernels; float32 1.038x.
//
// With `is_greedy` the LM head's first argmax runs in the region too, after the final norm, and the step returns the
// token ids [M] instead of the final norm's output (decode_rows_greedy; the plan has a head, and in bfloat16
// AmxFirstArgmaxCall::copies_x(hidden) is false): amx_linear_first_argmax's units in bfloat16; in float32 the
// head's small_batch_linear units into logits, then cpu_first_argmax's row function on each row (its thread's), the
// module path's compute_logits and greedy sampler.
template <typename scalar_t>
at::Tensor run_layers_in_one_region(const DecodeStackPlan& plan, const StepInputs& step, bool is_greedy) {
  using pagedserve_native::AmxFirstArgmaxCall;
  using pagedserve_native::AmxLinearCall;
  using pagedserve_native::DecodeAttentionCall;
  using pagedserve_native::GgufLinearCall;
  using pagedserve_native::Int8LinearCall;
  using pagedserve_native::SmallBatchLinearCall;
  const int64_t num_layers = static_cast<int64_t>(plan.kv_caches.size());
  const int64_t num_heads = plan.num_heads, num_kv_heads = plan.num_kv_heads, head_dim = plan.head_dim;
  const int64_t num_tokens = step.input_ids.size(0);
  const int64_t hidden = plan.hidden_size();
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const std::vector<int64_t>& output_sizes = plan.output_sizes;
  const int64_t qkv_size = output_sizes[0], gate_up_size = output_sizes[2], inter = gate_up_size / 2;
  const float eps = static_cast<float>(plan.eps);
  const int64_t lanes = plan.reduction_lanes;
  const at::TensorOptions options = plan.final_norm.options();

  // Checked here, before any thread starts: what the ops would raise inside the region.
  const int64_t* ids = step.input_ids.data_ptr<int64_t>();
  const int64_t vocab_size = plan.embedding.size(0);
  for (int64_t row = 0; row < num_tokens; ++row)
    TORCH_CHECK_INDEX(ids[row] >= 0 && ids[row] < vocab_size, "index ", ids[row], " is out of range in self (",
                      vocab_size, " embeddings)");
  const at::Tensor& first_cache = plan.kv_caches[0];
  const int64_t num_slots = first_cache.size(1) * first_cache.size(2);
  const int64_t* slots = step.slot_mapping.data_ptr<int64_t>();
  const int64_t slot_stride = step.slot_mapping.stride(0);
  for (int64_t row = 0; row < num_tokens; ++row)
    TORCH_CHECK(slots[row * slot_stride] < num_slots, "reshape_and_cache: slot_mapping[", row, "]=",
                slots[row * slot_stride], " is out of range [0, ", num_slots, ")");

  // Every stage's output, each read by the next stages before the next layer writes it again.
  const at::Tensor residual = at::empty({num_tokens, hidden}, options);
  const at::Tensor normed = at::empty({num_tokens, hidden}, options);
  const at::Tensor qkv = at::empty({num_tokens, qkv_size}, options);
  const at::Tensor query = at::empty({num_tokens, num_heads, head_dim}, options);
  const at::Tensor key = at::empty({num_tokens, num_kv_heads, head_dim}, options);
  const at::Tensor attended = at::empty({num_tokens, num_heads, head_dim}, options);
  const at::Tensor attended_rows = attended.view({num_tokens, q_size});
  const at::Tensor projected = at::empty({num_tokens, output_sizes[1]}, options);
  const at::Tensor gate_up = at::empty({num_tokens, gate_up_size}, options);
  const at::Tensor activated = at::empty({num_tokens, inter}, options);
  const at::Tensor states = at::empty({num_tokens, output_sizes[3]}, options);
  const at::Tensor out = at::empty({num_tokens, hidden}, options);
  const int requested_threads = std::max(1, at::get_num_threads());
  std::unique_ptr<AmxFirstArgmaxCall> head;  // bfloat16: each thread's units into its own slot
  std::unique_ptr<SmallBatchLinearCall> head_linear;  // float32: the logits (a GGUF head's call is made per thread
                                                      // in the region: it reads x when made)
  at::Tensor token_ids, logits;
  const int32_t* allowed_words = nullptr;  // float32 heads: the rows' allowed tokens (StepInputs.allowed_tokens)
  int64_t num_allowed_words = 0;
  if (is_greedy && step.allowed_tokens.has_value()) {
    pagedserve_native::check_allowed_tokens("decode_rows_greedy", *step.allowed_tokens, num_tokens,
                                            plan.head_num_columns);
    allowed_words = step.allowed_tokens->data_ptr<int32_t>();
    num_allowed_words = step.allowed_tokens->size(1);
  }
  if (is_greedy) {
    token_ids = at::empty({num_tokens}, options.dtype(at::kLong));
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      head = std::make_unique<AmxFirstArgmaxCall>(out, plan.head_weight, plan.head_bias, plan.head_output_size,
                                                  plan.head_num_columns, "auto", requested_threads,
                                                  step.allowed_tokens);
    } else {
      logits = at::empty({num_tokens, plan.head_output_size}, options);
      if (plan.head_type == 0)
        head_linear = std::make_unique<SmallBatchLinearCall>(out, plan.head_weight, plan.head_bias, logits);
    }
  }
  // One attention plan per distinct sliding window (the items depend on the window, not on the layer's cache,
  // whose sizes one_region_capable checked equal): planning all 30 layers' took most of the ~46 us spent before
  // the region of a batch-1 step (measured with rdtsc on an AMD Zen 4 VM).
  std::vector<std::unique_ptr<DecodeAttentionCall>> attention_plans;
  std::vector<const DecodeAttentionCall*> attention(num_layers);
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    for (int64_t earlier = 0; earlier < layer && attention[layer] == nullptr; ++earlier)
      if (plan.sliding_windows[earlier] == plan.sliding_windows[layer]) attention[layer] = attention[earlier];
    if (attention[layer] != nullptr) continue;
    const std::optional<at::Tensor> layer_scales =
        plan.is_int8_cache() ? std::optional<at::Tensor>(plan.kv_scales[layer]) : std::nullopt;
    attention_plans.push_back(std::make_unique<DecodeAttentionCall>(query, plan.kv_caches[layer], layer_scales,
                                                                    step.block_table, step.seq_lens, plan.scale,
                                                                    sliding_window(plan, layer), plan.partition_size,
                                                                    attended));
    attention[layer] = attention_plans.back().get();
  }

  const auto data = [](const at::Tensor& tensor) { return tensor.data_ptr<scalar_t>(); };
  scalar_t* const residual_data = data(residual);
  scalar_t* const normed_data = data(normed);
  scalar_t* const qkv_data = data(qkv);
  scalar_t* const query_data = data(query);
  scalar_t* const key_data = data(key);
  scalar_t* const projected_data = data(projected);
  scalar_t* const gate_up_data = data(gate_up);
  scalar_t* const activated_data = data(activated);
  scalar_t* const states_data = data(states);
  // A float table's rows are copied; a GGUF table's decoded (embedding_type != 0).
  const scalar_t* const embedding_data = plan.embedding_type == 0 ? data(plan.embedding) : nullptr;
  const uint8_t* const embedding_blocks = plan.embedding_type != 0 ? plan.embedding.data_ptr<uint8_t>() : nullptr;
  const float* const cos_sin_data = plan.cos_sin_cache.data_ptr<float>();
  const int64_t* const positions = step.positions.data_ptr<int64_t>();
  const int64_t cache_token_elements = kv_size;  // one slot of one plane
  const int64_t value_plane = num_slots * cache_token_elements;
  // int8 caches: every layer's pages (int8 views of one layout; strides in bytes) and scale views (floats).
  const bool is_int8 = plan.is_int8_cache();
  std::vector<int8_t*> layer_pages;
  std::vector<float*> scale_pages;
  int64_t int8_strides[3] = {0, 0, 0}, scale_strides[3] = {0, 0, 0};
  const int64_t block_size = first_cache.size(2);
  if (is_int8) {
    for (int64_t layer = 0; layer < num_layers; ++layer) {
      layer_pages.push_back(plan.kv_caches[layer].data_ptr<int8_t>());
      scale_pages.push_back(plan.kv_scales[layer].data_ptr<float>());
    }
    for (int dim = 0; dim < 3; ++dim) {
      int8_strides[dim] = first_cache.stride(dim);
      scale_strides[dim] = plan.kv_scales[0].stride(dim);
    }
  }

  pagedserve_native::SpinBarrier barrier;
  std::exception_ptr error;
  std::mutex error_mutex;

#pragma omp parallel num_threads(requested_threads)
  {
    const int64_t thread = omp_get_thread_num(), num_threads = omp_get_num_threads();
    barrier.set_num_threads(static_cast<int>(num_threads));
    // Thread `thread`'s share of one product (`quantization`: the weight's block type, kind 5, or scales, kind 6).
    const auto product = [&](const at::Tensor& x, const at::Tensor& weight, const OptionalTensor& bias, int64_t n,
                             const at::Tensor& y, const LinearQuantization& quantization) {
      if (plan.linear_kind == kW8A8) {
        // Each thread quantizes x itself (a few rows): the call's units then read only its own copy.
        const Int8LinearCall call(x, weight, *quantization.weight_scale,
                                  quantization.input_scale->value_or(at::Tensor()), bias.value_or(at::Tensor()), y);
        const auto [begin, end] = thread_share(call.num_units(), thread, num_threads);
        call.run_units(begin, end);
        return;
      }
      const int64_t ggml_type = quantization.ggml_type;
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        const AmxLinearCall call(x, weight, bias, n, "auto", y);
        const auto [begin, end] = thread_share(call.num_units(), thread, num_threads);
        call.run_units(begin, end);
      } else if (plan.linear_kind == kGguf && quantization.gguf_parts != nullptr) {
        // Each part into its columns of y, every thread taking its share of each part in turn.
        for (const GgufPart& part : *quantization.gguf_parts) {
          const at::Tensor blocks = part.blocks(weight);
          const GgufLinearCall call(x, blocks, part.ggml_type, part.bias(bias),
                                    y.narrow(1, part.column, part.num_columns));
          const auto [begin, end] = thread_share(call.num_units(), thread, num_threads);
          call.run_units(begin, end);
        }
      } else if (plan.linear_kind == kGguf) {
        const GgufLinearCall call(x, weight, ggml_type, bias, y);
        const auto [begin, end] = thread_share(call.num_units(), thread, num_threads);
        call.run_units(begin, end);
      } else {
        const SmallBatchLinearCall call(x, weight, bias, y);
        const auto [begin, end] = thread_share(call.num_units(), thread, num_threads);
        call.run_units(begin, end);
      }
    };
    // This thread's rows of the few-row stages (each row is one thread's, as in the ops).
    const auto [first_row, end_row] = thread_share(num_tokens, thread, num_threads);
    std::vector<float> rounded_row(head_dim);  // RoPE's cos/sin row in the dtype
    try {
      bool is_running = true;
      // Each stage ends at a barrier; false: another thread raised, leave the region.
      const auto stage_done = [&] { return is_running = barrier.wait(); };
      // LlamaDecoderLayer.forward of layer 0: the residual is the embedding.
      for (int64_t row = first_row; row < end_row; ++row) {
        if constexpr (std::is_same_v<scalar_t, float>) {
          if (embedding_blocks != nullptr)
            pagedserve_native::gguf_decode_row(embedding_blocks, plan.embedding.size(1), ids[row], plan.embedding_type,
                                               hidden, residual_data + row * hidden);
        }
        if (embedding_data != nullptr)
          std::memcpy(residual_data + row * hidden, embedding_data + ids[row] * hidden, hidden * sizeof(scalar_t));
        pagedserve_native::rms_norm_row(residual_data + row * hidden, data(plan.weights[0]), normed_data + row * hidden,
                                        hidden, eps, lanes);
      }
      for (int64_t layer = 0; layer < num_layers && is_running; ++layer) {
        const at::Tensor* w = plan.weights.data() + layer * kWeightsPerLayer;
        const OptionalTensor* layer_biases = plan.biases.data() + layer * kBiasesPerLayer;
        const auto quantization_of = [&plan, layer](int64_t part) { return plan.quantization_of(layer, part); };
        if (layer > 0)
          for (int64_t row = first_row; row < end_row; ++row)
            pagedserve_native::add_rms_norm_row(states_data + row * hidden, residual_data + row * hidden, data(w[0]),
                                                normed_data + row * hidden, residual_data + row * hidden, hidden,
                                                eps, lanes);
        if (!stage_done()) break;
        product(normed, w[1], layer_biases[0], qkv_size, qkv, quantization_of(0));
        if (!stage_done()) break;
        {
          // RoPE on q and k, then the K/V write into the layer's cache: the rows copied (a cache of the model's
          // dtype), or each KV head's row quantized as reshape_and_cache_int8 does (int8 pages and their scales).
          const at::Tensor& layer_cache = plan.kv_caches[layer];
          for (int64_t row = first_row; row < end_row; ++row) {
            const scalar_t* const qkv_row = qkv_data + row * qkv_size;
            scalar_t* const key_row = key_data + row * kv_size;
            pagedserve_native::rotate_token(cos_sin_data + positions[row] * head_dim, rounded_row.data(), qkv_row,
                                            head_dim, num_heads, query_data + row * q_size, qkv_row + q_size,
                                            head_dim, num_kv_heads, key_row, head_dim);
            const int64_t slot = slots[row * slot_stride];
            if (slot < 0) continue;  // padding
            const scalar_t* const value_row = qkv_row + q_size + kv_size;
            if (is_int8) {
              const int64_t block_id = slot / block_size, in_block = slot % block_size;
              int8_t* const key_slot = layer_pages[layer] + block_id * int8_strides[1] + in_block * int8_strides[2];
              float* const key_scales = scale_pages[layer] + block_id * scale_strides[1] + in_block * scale_strides[2];
              for (int64_t head = 0; head < num_kv_heads; ++head) {
                key_scales[head] = pagedserve_native::quantize_int8_row(key_row + head * head_dim, head_dim,
                                                                        key_slot + head * head_dim);
                key_scales[scale_strides[0] + head] = pagedserve_native::quantize_int8_row(
                    value_row + head * head_dim, head_dim, key_slot + int8_strides[0] + head * head_dim);
              }
              continue;
            }
            scalar_t* const key_slot = data(layer_cache) + slot * cache_token_elements;
            std::memcpy(key_slot, key_row, kv_size * sizeof(scalar_t));
            std::memcpy(key_slot + value_plane, value_row, kv_size * sizeof(scalar_t));
          }
        }
        if (!stage_done()) break;
        const DecodeAttentionCall& layer_attention = *attention[layer];
        {
          const auto [begin, end] = thread_share(layer_attention.num_items(), thread, num_threads);
          if (plan.is_int8_cache())
            layer_attention.run_items_on(plan.kv_caches[layer], plan.kv_scales[layer], begin, end);
          else
            layer_attention.run_items_on(plan.kv_caches[layer], begin, end);
        }
        if (!stage_done()) break;
        if (layer_attention.num_merges() > 0) {
          const auto [begin, end] = thread_share(layer_attention.num_merges(), thread, num_threads);
          layer_attention.merge(begin, end);
          if (!stage_done()) break;
        }
        product(attended_rows, w[2], layer_biases[1], output_sizes[1], projected, quantization_of(1));
        if (!stage_done()) break;
        for (int64_t row = first_row; row < end_row; ++row)
          pagedserve_native::add_rms_norm_row(projected_data + row * hidden, residual_data + row * hidden, data(w[3]),
                                              normed_data + row * hidden, residual_data + row * hidden, hidden, eps,
                                              lanes);
        if (!stage_done()) break;
        product(normed, w[4], layer_biases[2], gate_up_size, gate_up, quantization_of(2));
        if (!stage_done()) break;
        for (int64_t row = first_row; row < end_row; ++row)
          pagedserve_native::silu_and_mul_row(gate_up_data + row * gate_up_size, activated_data + row * inter, inter);
        if (!stage_done()) break;
        product(activated, w[5], layer_biases[3], output_sizes[3], states, quantization_of(3));
        stage_done();
      }
      if (is_running)
        for (int64_t row = first_row; row < end_row; ++row)
          pagedserve_native::add_rms_norm_row(states_data + row * hidden, residual_data + row * hidden,
                                              data(plan.final_norm), data(out) + row * hidden,
                                              residual_data + row * hidden, hidden, eps, lanes);
      if (is_greedy && is_running && stage_done()) {
        if (head != nullptr) {
          const auto [begin, end] = thread_share(head->num_units(), thread, num_threads);
          head->run_units(begin, end, thread);
        } else {
          if (plan.head_type != 0) {
            product(out, plan.head_weight, plan.head_bias, plan.head_output_size, logits,
                    LinearQuantization{plan.head_type});
          } else {
            const auto [begin, end] = thread_share(head_linear->num_units(), thread, num_threads);
            head_linear->run_units(begin, end);
          }
          if (stage_done()) {
            float* const logits_data = logits.data_ptr<float>();
            int64_t* const token_data = token_ids.data_ptr<int64_t>();
            for (int64_t row = first_row; row < end_row; ++row) {
              float* const row_logits = logits_data + row * plan.head_output_size;
              if (allowed_words != nullptr)
                pagedserve_native::mask_disallowed_tokens(row_logits, 0, plan.head_num_columns,
                                                          allowed_words + row * num_allowed_words);
              token_data[row] = pagedserve_native::first_argmax_row(row_logits, plan.head_num_columns);
            }
          }
        }
      }
    } catch (...) {
      {
        const std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
      }
      barrier.abort();
    }
  }
  if (error) std::rethrow_exception(error);
  if (!is_greedy) return out;
  if (head != nullptr) head->finish(token_ids.data_ptr<int64_t>());
  return token_ids;
}

// Whether a step runs its layers in one parallel region (run_layers_in_one_region), else op by op.
bool takes_one_region(const DecodeStackPlan& plan, const StepInputs& step) {
  const at::Tensor& input_ids = step.input_ids;
  const at::Tensor& slot_mapping = step.slot_mapping;
  return input_ids.size(0) <= plan.one_region_rows_limit() && input_ids.scalar_type() == at::kLong &&
         input_ids.is_contiguous() && slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
         slot_mapping.size(0) == input_ids.size(0) && !omp_in_parallel();
}

// llama_decode_stack's and decode_rows_greedy's step: the final norm's output, or with `is_greedy` the
// head's first argmax of every row.
at::Tensor decode_step(DecodeStackPlan& plan, const StepInputs& step, int64_t max_positions, bool is_greedy) {
  const at::Tensor& input_ids = step.input_ids;
  const at::Tensor& positions = step.positions;
  const at::Tensor& cos_sin_cache = plan.cos_sin_cache;
  TORCH_CHECK(input_ids.dim() == 1 && input_ids.size(0) >= 1 && positions.dim() == 1 &&
                  positions.size(0) == input_ids.size(0) &&
                  positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "llama_decode_stack: input_ids [M] and contiguous int64 positions [M], M >= 1, expected, got ",
              input_ids.sizes(), " and ", positions.sizes(), " ", positions.scalar_type());
  TORCH_CHECK(max_positions <= cos_sin_cache.size(0), "llama_decode_stack: max_positions=", max_positions,
              " exceeds the rotary table's ", cos_sin_cache.size(0), " rows");
  const int64_t* position_data = positions.data_ptr<int64_t>();
  const int64_t max_position = *std::max_element(position_data, position_data + positions.size(0));
  TORCH_CHECK_VALUE(max_position < max_positions, "position ", max_position,
                    " is beyond the rotary table (max_positions=", max_positions, ")");
  const Kernels& kernels = Kernels::get();
  // The ops below need no autograd (inference): skip the autograd and view-tracking layers of each dispatch.
  at::AutoDispatchBelowADInplaceOrView below_autograd;

  if (takes_one_region(plan, step)) {
    // The head joins the region, in bfloat16 when its call reads x only as its units run.
    const bool is_greedy_in_region =
        is_greedy && (!plan.is_bfloat16_region() ||
                      !pagedserve_native::AmxFirstArgmaxCall::copies_x(plan.hidden_size()));
    ++plan.num_one_region_steps;
    const at::Tensor result =
        plan.is_bfloat16_region() ? run_layers_in_one_region<c10::BFloat16>(plan, step, is_greedy_in_region)
                                  : run_layers_in_one_region<float>(plan, step, is_greedy_in_region);
    if (is_greedy_in_region || !is_greedy) return result;
    return kernels.first_argmax.call(result, plan.head_weight, plan.head_bias, plan.head_output_size,
                                     plan.head_num_columns, "auto", step.allowed_tokens);
  }
  TORCH_CHECK(!is_greedy || plan.is_bfloat16_region(),
              "decode_rows_greedy: a float32 head samples only in the one region (can_sample_greedy)");
  const at::Tensor hidden = run_layers_op_by_op(plan, kernels, step);
  if (!is_greedy) return hidden;
  return kernels.first_argmax.call(hidden, plan.head_weight, plan.head_bias, plan.head_output_size,
                                   plan.head_num_columns, "auto", step.allowed_tokens);
}

at::Tensor llama_decode_stack(const c10::intrusive_ptr<DecodeStackPlan>& plan, const at::Tensor& input_ids,
                              const at::Tensor& positions, const at::Tensor& block_table, const at::Tensor& seq_lens,
                              const at::Tensor& slot_mapping, int64_t max_positions) {
  return decode_step(*plan, StepInputs{input_ids, positions, block_table, seq_lens, slot_mapping}, max_positions,
                     false);
}

// llama_decode_stack with the LM head's greedy pick of every row (a greedy verification of drafts, each token a
// row): the token ids [M], or an empty tensor, with nothing run, when the plan has no head or a float32 step would
// not take its one region (the float32 head samples only there).
at::Tensor llama_decode_stack_greedy(const c10::intrusive_ptr<DecodeStackPlan>& plan, const at::Tensor& input_ids,
                                     const at::Tensor& positions, const at::Tensor& block_table,
                                     const at::Tensor& seq_lens, const at::Tensor& slot_mapping,
                                     int64_t max_positions) {
  const StepInputs step{input_ids, positions, block_table, seq_lens, slot_mapping};
  if (input_ids.dim() != 1 || !plan->can_sample_greedy(input_ids.size(0)) ||
      !(plan->is_bfloat16_region() || takes_one_region(*plan, step)))
    return at::empty({0}, at::TensorOptions().dtype(at::kLong));
  return decode_step(*plan, step, max_positions, true);
}

// The runner's greedy decode step of rows `rows` of the bound batch (see the header): each row's inputs are its
// last token at position num_computed_tokens, the step's token ids come from the head, and each is appended to its
// row (token_ids[row, num_tokens] = token, num_tokens += 1), as the runner's InputBatch.append_tokens does.
at::Tensor decode_rows_greedy(DecodeStackPlan& p, const int64_t* row_ids, int64_t num_rows, int64_t max_positions,
                              const OptionalTensor& allowed) {
  TORCH_CHECK(p.batch_token_ids.defined(), "decode_rows_greedy: no batch bound (DecodeStackPlan.bind_batch)");
  TORCH_CHECK(p.head_weight.defined(),
              "decode_rows_greedy: the plan has no LM head (DecodeStackPlan.set_greedy_head)");
  TORCH_CHECK(num_rows >= 1, "decode_rows_greedy: at least one row expected");
  if (!p.can_sample_greedy(num_rows)) return at::empty({0}, at::TensorOptions().dtype(at::kLong));
  const int64_t num_batch_rows = p.batch_token_ids.size(0);
  const int64_t max_len = p.batch_token_ids.size(1), table_columns = p.batch_block_table.size(1);
  const int64_t block_size = p.kv_caches[0].size(2);
  int64_t* const token_ids = p.batch_token_ids.data_ptr<int64_t>();
  int64_t* const num_tokens = p.batch_num_tokens.data_ptr<int64_t>();
  const int64_t* const num_computed = p.batch_num_computed_tokens.data_ptr<int64_t>();
  const int32_t* const table = p.batch_block_table.data_ptr<int32_t>();
  const int64_t* const num_blocks = p.batch_num_blocks.data_ptr<int64_t>();
  const at::TensorOptions long_options = at::TensorOptions().dtype(at::kLong);
  at::Tensor input_ids = at::empty({num_rows}, long_options), positions = at::empty({num_rows}, long_options);
  at::Tensor slot_mapping = at::empty({num_rows}, long_options);
  at::Tensor seq_lens = at::empty({num_rows}, long_options.dtype(at::kInt));
  int64_t max_blocks = 1;
  for (int64_t m = 0; m < num_rows; ++m) {
    const int64_t row = row_ids[m];
    TORCH_CHECK(row >= 0 && row < num_batch_rows, "decode_rows_greedy: rows[", m, "]=", row,
                " is outside the batch's ", num_batch_rows, " rows");
    const int64_t position = num_computed[row];
    if (position < 0 || position + 1 != num_tokens[row]) return at::empty({0}, long_options);  // not sampled
    TORCH_CHECK(num_tokens[row] < max_len, "decode_rows_greedy: row ", row, " holds ", num_tokens[row],
                " tokens, the batch's limit (max_model_len=", max_len, "): no room for the next");
    const int64_t block = position / block_size;
    TORCH_CHECK(block < num_blocks[row] && num_blocks[row] <= table_columns, "decode_rows_greedy: row ", row,
                " has ", num_blocks[row], " blocks; position ", position, " needs ", block + 1);
    input_ids.data_ptr<int64_t>()[m] = token_ids[row * max_len + position];
    positions.data_ptr<int64_t>()[m] = position;
    seq_lens.data_ptr<int32_t>()[m] = static_cast<int32_t>(position + 1);
    slot_mapping.data_ptr<int64_t>()[m] = table[row * table_columns + block] * block_size + position % block_size;
    max_blocks = std::max(max_blocks, block + 1);
  }
  at::Tensor block_table = at::empty({num_rows, max_blocks}, long_options.dtype(at::kInt));
  for (int64_t m = 0; m < num_rows; ++m)
    std::memcpy(block_table.data_ptr<int32_t>() + m * max_blocks, table + row_ids[m] * table_columns,
                max_blocks * sizeof(int32_t));
  const at::Tensor sampled =
      decode_step(p, StepInputs{input_ids, positions, block_table, seq_lens, slot_mapping, allowed}, max_positions,
                  true);
  const int64_t* sampled_ids = sampled.data_ptr<int64_t>();
  for (int64_t m = 0; m < num_rows; ++m) {
    const int64_t row = row_ids[m];
    token_ids[row * max_len + num_tokens[row]] = sampled_ids[m];
    ++num_tokens[row];
  }
  return sampled;
}

// decode_rows_greedy as the Python binding takes it: the plan by handle, the rows and the token ids as lists.
std::vector<int64_t> decode_rows_greedy_by_handle(int64_t handle, const std::vector<int64_t>& rows,
                                                  int64_t max_positions, const OptionalTensor& allowed) {
  DecodeStackPlan* plan = nullptr;
  {
    PlanRegistry& registry = PlanRegistry::get();
    const std::lock_guard<std::mutex> lock(registry.mutex);
    const auto found = registry.plans.find(handle);
    TORCH_CHECK(found != registry.plans.end(), "decode_rows_greedy: no live DecodeStackPlan has handle ", handle);
    plan = found->second;
  }
  const at::Tensor sampled =
      decode_rows_greedy(*plan, rows.data(), static_cast<int64_t>(rows.size()), max_positions, allowed);
  const int64_t* data = sampled.data_ptr<int64_t>();
  return std::vector<int64_t>(data, data + sampled.numel());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.class_<DecodeStackPlan>("DecodeStackPlan")
      .def(torch::init<std::vector<at::Tensor>, c10::List<OptionalTensor>, std::vector<at::Tensor>, at::Tensor,
                       at::Tensor, at::Tensor, std::vector<int64_t>, std::vector<int64_t>, int64_t, int64_t, int64_t,
                       double, double, int64_t, int64_t, int64_t, int64_t>())
      .def("num_one_region_steps",
           [](const c10::intrusive_ptr<DecodeStackPlan>& self) { return self->num_one_region_steps; })
      .def("set_greedy_head", &DecodeStackPlan::set_greedy_head)
      .def("set_gguf_types", &DecodeStackPlan::set_gguf_types)
      .def("set_gguf_parts", &DecodeStackPlan::set_gguf_parts)
      .def("set_w8a8_scales", &DecodeStackPlan::set_w8a8_scales)
      .def("set_kv_scales", &DecodeStackPlan::set_kv_scales)
      .def("bind_batch", &DecodeStackPlan::bind_batch)
      .def("handle", &DecodeStackPlan::handle)
      .def("has_greedy_head",
           [](const c10::intrusive_ptr<DecodeStackPlan>& self) { return self->head_weight.defined(); });
  // The plan's KV caches are written (the schema cannot say so of a class's tensors: eager use only, as the stack).
  m.def(
      "llama_decode_stack(__torch__.torch.classes.pagedserve.DecodeStackPlan plan, Tensor input_ids, "
      "Tensor positions, Tensor block_table, Tensor seq_lens, Tensor slot_mapping, int max_positions) -> Tensor");
  m.def(
      "llama_decode_stack_greedy(__torch__.torch.classes.pagedserve.DecodeStackPlan plan, Tensor input_ids, "
      "Tensor positions, Tensor block_table, Tensor seq_lens, Tensor slot_mapping, int max_positions) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("llama_decode_stack", &llama_decode_stack);
  m.impl("llama_decode_stack_greedy", &llama_decode_stack_greedy);
}

// The library is also a Python module (cpu_library.native_module()): calls that a batch-1 decode step makes
// once per token skip the dispatcher (see PlanRegistry). c10 errors become the Python exceptions torch raises for them.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def(
      "decode_rows_greedy",
      [](int64_t handle, const std::vector<int64_t>& rows, int64_t max_positions,
         const OptionalTensor& allowed) -> std::vector<int64_t> {
        HANDLE_TH_ERRORS
        return decode_rows_greedy_by_handle(handle, rows, max_positions, allowed);
        END_HANDLE_TH_ERRORS_PYBIND
      },
      "The greedy decode step of these batch rows on the plan with this handle (DecodeStackPlan.handle()): the rows' "
      "token ids, [] when a row's next token is not sampled; `allowed` (int32 [rows, words]) restricts each row's "
      "pick to the tokens its bitmask allows",
      pybind11::arg("handle"), pybind11::arg("rows"), pybind11::arg("max_positions"),
      pybind11::arg("allowed") = pybind11::none());
}
