// The SiLU of every bfloat16 value, shared by the kernels that apply SiLU-and-mul to bfloat16 gates.
#pragma once

#include <cstdint>

namespace pagedserve_native {

// Entry g (a bfloat16 bit pattern) holds the bits of silu(g) computed in float32 by elementwise.cpp's vector
// formula and rounded to bfloat16 (so a gather from it is bitwise that kernel's silu); 2^16 + 1 entries, the last a
// spare for 4-byte gathers at 2-byte indices. Built at first call (thread safe). Defined in elementwise.cpp for
// AVX-512 builds.
const uint16_t* bfloat16_silu_table();

}  // namespace pagedserve_native
