// Structured outputs in the greedy heads: a row's allowed tokens as the grammar's bitmask words give them (bit j of
// int32 word w set: token 32 w + j allowed; structured_output/logits_mask.py), for the LM-head epilogues that take
// each row's first argmax without writing logits out (amx_linear.cpp's amx_linear_first_argmax, decode_stack.cpp's
// float32 head). A disallowed column counts as -inf, as xgrammar's apply_token_bitmask_inplace sets it before the
// sampler's first argmax: a disallowed NaN never wins, and a row whose allowed logits are all -inf gives the first
// column, as the masked row's first_argmax does.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>

namespace pagedserve_native {

inline bool is_allowed_token(const int32_t* words, int64_t column) {
  return ((static_cast<uint32_t>(words[column >> 5]) >> (column & 31)) & 1u) != 0;
}

// values[0:count] (columns first_column ...) set to -inf where `words` disallows the column.
inline void mask_disallowed_tokens(float* values, int64_t first_column, int64_t count, const int32_t* words) {
  for (int64_t column = 0; column < count; ++column)
    if (!is_allowed_token(words, first_column + column)) values[column] = -std::numeric_limits<float>::infinity();
}

// Checks an op's `allowed` argument: contiguous int32 [num_rows, num_words] covering num_columns tokens. The words
// of row r start at data + r * num_words.
inline void check_allowed_tokens(const char* op, const at::Tensor& allowed, int64_t num_rows, int64_t num_columns) {
  TORCH_CHECK(allowed.device().is_cpu() && allowed.scalar_type() == at::kInt && allowed.dim() == 2 &&
                  allowed.is_contiguous(),
              op, ": allowed must be a contiguous int32 CPU tensor [rows, words], got ", allowed.sizes(), " ",
              allowed.scalar_type());
  TORCH_CHECK(allowed.size(0) == num_rows && allowed.size(1) * 32 >= num_columns, op, ": allowed has shape ",
              allowed.sizes(), "; expected ", num_rows, " rows of at least ", (num_columns + 31) / 32,
              " words (", num_columns, " columns)");
}

}  // namespace pagedserve_native
