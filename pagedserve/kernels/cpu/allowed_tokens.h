// Structured outputs in the greedy heads: a row's allowed tokens as the grammar's bitmask words give them (bit j of
// int32 word w set: token 32 w + j allowed; structured_output/logits_mask.py), for the LM-head epilogues that take
// each row's first argmax without writing logits out (amx_linear.cpp's amx_linear_first_argmax, decode_stack.cpp's
// float32 head). A disallowed column counts as -inf, as xgrammar's apply_token_bitmask_inplace sets it before the
// sampler's first argmax: a disallowed NaN never wins, and a row whose allowed logits are all -inf gives the first
// column, as the masked row's first_argmax does.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace pagedserve_native {

// The allowed bits of columns column .. column + 15 (bit i: column + i), column a multiple of 16 (of 8: the low 8
// bits are those of column .. column + 7).
inline uint32_t allowed_token_bits(const int32_t* words, int64_t column) {
  return (static_cast<uint32_t>(words[column >> 5]) >> (column & 31)) & 0xFFFFu;
}

// values[0:count] (columns first_column ...) set to -inf where `words` disallows the column; a word at a time
// (grammar masks are mostly whole words allowed or refused).
inline void mask_disallowed_tokens(float* values, int64_t first_column, int64_t count, const int32_t* words) {
  constexpr float kMinusInfinity = -std::numeric_limits<float>::infinity();
  for (int64_t column = 0; column < count;) {
    const int64_t token = first_column + column, bit = token & 31;
    const int64_t span = std::min<int64_t>(32 - bit, count - column);  // columns left in this word
    const uint32_t word = static_cast<uint32_t>(words[token >> 5]) >> bit;
    if (word == 0) {
      std::fill(values + column, values + column + span, kMinusInfinity);
    } else if (span < 32 || word != 0xFFFFFFFFu) {
      for (int64_t i = 0; i < span; ++i)
        if (((word >> i) & 1u) == 0) values[column + i] = kMinusInfinity;
    }
    column += span;
  }
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
