// cpu_first_argmax's row function for callers in the same library (first_argmax.cpp).
#pragma once

#include <cstdint>

namespace pagedserve_native {

// The first index of the maximum of row[0, size), size >= 1: a NaN counts as larger than everything (the first NaN
// wins) and a row of -inf gives 0, exactly cpu_first_argmax's (and `max(dim=-1).indices`') answer for that row.
int64_t first_argmax_row(const float* row, int64_t size);

}  // namespace pagedserve_native
