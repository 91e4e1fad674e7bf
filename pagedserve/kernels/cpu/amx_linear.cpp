// bfloat16 linear on AMX tiles, AVX512-BF16 dot products, AVX-512 FMA or AVX2 FMA: y[M, N] = x[M, K] @ W[N, K]^T
// (+ bias), the weight in a tile-blocked layout.
//
// Python side: layers/amx_linear.py; the fused MLP pass (amx_linear_silu_and_mul) layers/amx_gate_up_silu.py; greedy
// sampling in the LM head's epilogue (amx_linear_first_argmax) sample/fused_greedy_head.py. amx_linear and
// amx_linear_first_argmax run the same work units (run_units) and differ only in their epilogue.
//
// Ops take `products`: "amx", "avx512_bf16", "avx512", "avx2" or "auto" (the first of amx_linear_products(), which
// lists what this build and process can run, preferred first). An AVX512-BF16 build (kernels/cpu_isa.py levels
// avx512_bf16 and amx) has "amx" (where Linux grants the tile state) and "avx512_bf16"; the avx512 level's build
// (AVX-512 without BF16: Skylake-SP, Cascade Lake, Ice Lake server) has "avx512" alone; an AVX2 build "avx2" alone.
// The units read the same packed tiles and fill the same fp32 unit results; only the inner products differ
// (AmxProducts, DotProducts, FmaProducts on 16 or 8 lanes).
//
// A decode step streams every weight once; oneDNN's packed bf16 GEMM streamed only 13-19 GB/s at M = 1..16 on an
// Intel Sapphire Rapids VM. AMX's TDPBF16PS multiplies a [rows x 32] bf16 tile by a [32 x 16] tile into [rows x 16]
// fp32 in one instruction, so at decode sizes the loop is bound by the weight stream alone (25-28 GB/s), and the same
// loop serves prefill sizes (there oneDNN's blocking is still ahead for some shapes: benchmarks/amx_linear.py).
// Without AMX (an AMD Zen 4 VM), VDPBF16PS against broadcast x pairs in register blocks of up to 24 accumulators
// streams the same layout at 23-24 GB/s at one row (oneDNN 17) and keeps up with oneDNN's compute up to prefill sizes
// (see DotProducts). Without bf16 instructions (AVX-512 without BF16, or AVX2 + FMA), the weights are widened to
// fp32 in registers and multiplied by fp32 FMA (FmaProducts), where torch's own bf16 GEMM on AVX2 runs 4-5x slower
// than its fp32 one.
//
// Packed layout (`amx_pack_weight`): N is cut into blocks of 16 output columns and K into steps of 32 (both
// zero-padded). A block's step is one B tile: 16 rows of K pairs, each row the 16 columns' (w[n][k], w[n][k+1])
// pairs (the VNNI order TDPBF16PS reads), 1 KiB. Blocks are grouped four at a time (64 columns, one C tile each);
// within a group the tiles run step-major (step 0 of blocks 0..3, step 1 of blocks 0..3, ...), so a group is one
// contiguous stream read front to back. The last group may hold fewer blocks.
//
// Work split and numerics:
// - Up to 256 rows (decode and small prefill steps) x is one chunk, which stays in L2 while the blocks of 16
//   columns are split evenly between torch's intra-op threads; each thread configures its own tiles.
// - On AMX, rows of x are taken 32 at a time while 32 are left (two A tiles, each B tile used by both: 2 x 2 C
//   tiles), then 16 at a time (one A tile against up to four B tiles); the last block uses a tile of fewer rows.
//   The dot products take them in register blocks of 6 rows against a whole group (12 against one block); AVX-512
//   FMA in blocks of 8 rows against two blocks (up to 4 rows against a whole group); AVX2 FMA in blocks of 5 rows
//   against one block (one row against a whole group, two rows against two blocks).
//   Beyond one row block the weights are read from L2 again for every row block, so each row block also
//   prefetches a share of the next group's weights (without it the memory sat idle: 0.7x oneDNN at 64 rows),
//   into L2: the next group (72 KiB for K = 576) does not fit in L1 beside the current one (prefetched into L1,
//   the 30 layers' linears ran 1.02-1.10x slower at 24-64 rows, interleaved).
// - Above 256 rows (prefill chunks) the weight is cut into panels of whole groups, up to kPanelWeightBytes each
//   (L2-resident), and x into chunks of 32 rows (one row pair, its A tiles in L1; 36 rows, six register blocks,
//   for the dot products; 32, four, for AVX-512 FMA; 35, seven, for AVX2); the units (panel, chunk, block) run
//   panel-major, split evenly between the threads, and nothing is prefetched (the panel is in L2). A chunk's row
//   pair then reads its A tiles from L1 and the panel's B tiles from L2 instead of both from L2.
//   The 30 layers of SmolLM2-135M at 2048 rows, interleaved with the 256-row chunking: 1.01-1.13x (median of
//   per-round ratios over seven runs, 1.04x); gate_up alone 1.27x in a fast phase. At 257-511 rows the 256-row
//   chunking also left one thread a short chunk: 320 rows ran 1.33x faster.
// - One output element: TDPBF16PS (or VDPBF16PS, per lane) over the K steps in order into fp32, + bias in fp32,
//   rounded to bf16 once. On the FMA units (AVX-512, AVX2) it is one fp32 FMA chain over k in order (each pair's
//   even k, then its odd k), + bias in fp32, rounded to bf16 once as c10::BFloat16 rounds: ties to even, subnormal
//   results kept (the AVX512-BF16 units' VCVTNEPS2BF16 flushes them to zero); the two FMA units are bitwise equal.
//   A row's result depends only on K and the weight: it is the same whatever M, the other rows or the thread count
//   (batch invariant), though not bitwise equal to oneDNN's GEMM (another summation order) nor between AMX, the dot
//   products and the FMA units.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "allowed_tokens.h"
#include "amx_linear.h"
#include "amx_tiles.h"
#include "bfloat16_rounding.h"
#include "bfloat16_silu_table.h"
#include "vector_avx2.h"

namespace {

constexpr int64_t kBlockColumns = 16;                            // output columns per B tile
constexpr int64_t kStepDepth = 32;                               // K elements per B tile (16 pairs)
constexpr int64_t kTileElements = kBlockColumns * kStepDepth;    // 512 bf16 = 1 KiB
constexpr int64_t kGroupBlocks = 4;                              // B tiles per group, one C tile each
constexpr int64_t kGroupColumns = kGroupBlocks * kBlockColumns;  // 64
constexpr int64_t kTileRows = 16;                                // rows of x per A tile
constexpr int64_t kChunkRows = 256;                              // rows of x per task (L2-resident)
constexpr int64_t kPanelChunkRows = 32;                          // rows of x per task above kChunkRows rows (AMX)
constexpr int64_t kDotPanelChunkRows = 36;  // the same for the dot-product unit (see panel_chunk_rows)
constexpr int64_t kFma16PanelChunkRows = 32;  // the same for the AVX-512 FMA unit (see panel_chunk_rows)
constexpr int64_t kFmaPanelChunkRows = 35;  // the same for the AVX2 unit (see panel_chunk_rows)
constexpr int64_t kMaxPanelChunkRows =
    std::max({kPanelChunkRows, kDotPanelChunkRows, kFma16PanelChunkRows, kFmaPanelChunkRows});
constexpr int64_t kPanelWeightBytes = 576 * 1024;                // weight bytes per panel above kChunkRows rows
constexpr int64_t kArgmaxLanes = 16;  // running maxima per row of amx_linear_first_argmax (16 columns' lanes)
constexpr int64_t kFarPrefetchBytes = 32 * 1024;                // see group_product (AMX)
// The dot-product unit's distance (dot_rows). Each of its threads also prefetches the first this many bytes of its
// share when it starts a streaming product (run_units), where the far prefetch of the steps has not reached yet.
// Measured on the Zen 4 VM, 121 decode-step products (SmolLM2-135M's layers and LM head) interleaved over six rounds
// (one row, before the one-row streams took that case): 16 KiB with the start prefetch 1.05x 32 KiB alone.
constexpr int64_t kDotFarPrefetchBytes = 16 * 1024;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The dot-product unit's gate; AMX implies it (amx_tiles.h asks for AVX512-BF16 too).
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGEDSERVE_DPBF16 1
#endif
// The FMA units' gates: vector_avx2.h's PAGEDSERVE_AVX2 (AVX2 + FMA, no AVX-512) for the 8-lane one, and AVX-512
// F/BW/VL without AVX512-BF16 (the avx512 level) for the 16-lane one. So a build has one unit besides AMX: the dot
// products, the 16-lane FMA or the 8-lane FMA. PAGEDSERVE_PACKED_LINEAR: some unit exists, and with it the shared
// unit walk (run_units) and the epilogues, each in the form of its build's vectors.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && !defined(PAGEDSERVE_DPBF16)
#define PAGEDSERVE_FMA16 1
#endif
#if defined(PAGEDSERVE_DPBF16) || defined(PAGEDSERVE_FMA16) || defined(PAGEDSERVE_AVX2)
#define PAGEDSERVE_PACKED_LINEAR 1
#endif

constexpr const char* kAmxProducts = "amx";
constexpr const char* kDotProducts = "avx512_bf16";
constexpr const char* kFma16Products = "avx512";
constexpr const char* kFmaProducts = "avx2";
constexpr const char* kNoUnitMessage = ": this build has no product unit (AMX, AVX512-BF16, AVX-512 or AVX2)";

// The product units this build and process can run, preferred first.
std::vector<std::string> amx_linear_products() {
  std::vector<std::string> units;
  if (pagedserve_native::is_amx_usable()) units.emplace_back(kAmxProducts);
#if defined(PAGEDSERVE_DPBF16)
  units.emplace_back(kDotProducts);
#endif
#if defined(PAGEDSERVE_FMA16)
  units.emplace_back(kFma16Products);
#endif
#if defined(PAGEDSERVE_AVX2)
  units.emplace_back(kFmaProducts);
#endif
  return units;
}

bool is_amx_linear_supported() { return !amx_linear_products().empty(); }

void check_supported(const char* op) {
  TORCH_CHECK(is_amx_linear_supported(), op, kNoUnitMessage, " (is_amx_linear_supported() is False here)");
}

// The unit `products` names ('auto': the first of amx_linear_products()), checked against what is available.
std::string resolve_products(const char* op, c10::string_view products) {
  TORCH_CHECK(products == "auto" || products == kAmxProducts || products == kDotProducts ||
                  products == kFma16Products || products == kFmaProducts,
              op, ": products must be 'auto', 'amx', 'avx512_bf16', 'avx512' or 'avx2', got '", products, "'");
  const std::vector<std::string> units = amx_linear_products();
  TORCH_CHECK(!units.empty(), op, kNoUnitMessage);
  const std::string unit = products == "auto" ? units.front() : std::string(products);
  TORCH_CHECK(std::find(units.begin(), units.end(), unit) != units.end(), op, ": products='", products,
              "' is not available in this build or process (amx_linear_products() lists what is)");
  return unit;
}

// Rows of x per task above kChunkRows rows for the unit `kind`: AMX takes them as one row pair (two A tiles); the
// dot-product unit as six blocks of 6 rows (with 32 rows its last block of 2 rows ran 1.5x slower per row: over
// SmolLM2-135M's 30 layers at 2048 rows, 383 against 405 GFLOP/s with 36, oneDNN 413); the AVX-512 FMA unit as
// four blocks of 8 rows, the AVX2 unit as seven blocks of 5 rows (FmaProducts).
int64_t panel_chunk_rows(const std::string& kind) {
  if (kind == kAmxProducts) return kPanelChunkRows;
  if (kind == kDotProducts) return kDotPanelChunkRows;
  return kind == kFma16Products ? kFma16PanelChunkRows : kFmaPanelChunkRows;
}

// A partial group streamed beside whole ones (DotProducts::stream_groups at one row): its first `num_blocks` blocks
// from `first` (the first block's tile of step 0), a step's tiles `step_stride` elements apart, results to `out`.
struct PartialStream {
  const at::BFloat16* first = nullptr;
  int64_t step_stride = 0;
  int64_t num_blocks = 0;  // 0: no partial stream
  float* out = nullptr;
};

#if defined(PAGEDSERVE_AMX)

// Tiles 0-3: C, rows x 16 fp32; tiles 4-5: A, rows x 32 bf16; tiles 6-7: B, 16 K pairs x 16 columns.
void configure_tiles(int64_t rows) {
  const uint8_t r = static_cast<uint8_t>(rows);
  pagedserve_native::configure_tile_rows({r, r, r, r, r, r, 16, 16});
}

// One row block against kBlocks consecutive blocks of a group: C[rows x 16 * kBlocks] from one A tile, over all
// K steps. `b_first` is the first block's tile of step 0; a step's tiles are `step_stride` elements apart (the
// group's blocks x 1 KiB). Stored to `out` (row stride kGroupColumns floats). Each step also prefetches
// `prefetch_lines` cache lines from `prefetch` on (see amx_linear).
template <int kBlocks>
inline void group_product(const at::BFloat16* x, int64_t x_stride_bytes, const at::BFloat16* b_first,
                          int64_t step_stride, int64_t num_steps, float* out, const char*& prefetch,
                          int64_t prefetch_lines) {
  _tile_zero(0);
  if (kBlocks > 1) _tile_zero(1);
  if (kBlocks > 2) _tile_zero(2);
  if (kBlocks > 3) _tile_zero(3);
  for (int64_t step = 0; step < num_steps; ++step) {
    const at::BFloat16* b = b_first + step * step_stride;
    for (int64_t line = 0; line < prefetch_lines; ++line) _mm_prefetch(prefetch + line * 64, _MM_HINT_T1);
    prefetch += prefetch_lines * 64;
    if (prefetch_lines == 0) {
      // One row block (decode sizes): the weight stream is the whole cost. Prefetching this step's bytes again
      // kFarPrefetchBytes further on (into L2/L3; the packed groups follow each other in memory) keeps more of
      // the stream in flight than the hardware prefetcher alone (+20% on a decode step's weights at M = 1 and 4).
      const char* far = reinterpret_cast<const char*>(b) + kFarPrefetchBytes;
      for (int64_t line = 0; line < kBlocks * kTileElements * 2 / 64; ++line)
        _mm_prefetch(far + line * 64, _MM_HINT_T2);
    }
    _tile_loadd(4, x + step * kStepDepth, x_stride_bytes);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (kBlocks > 1) {
      _tile_loadd(7, b + kTileElements, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (kBlocks > 2) {
      _tile_loadd(6, b + 2 * kTileElements, 64);
      _tile_dpbf16ps(2, 4, 6);
    }
    if (kBlocks > 3) {
      _tile_loadd(7, b + 3 * kTileElements, 64);
      _tile_dpbf16ps(3, 4, 7);
    }
  }
  constexpr int64_t stride = kGroupColumns * sizeof(float);
  _tile_stored(0, out, stride);
  if (kBlocks > 1) _tile_stored(1, out + kBlockColumns, stride);
  if (kBlocks > 2) _tile_stored(2, out + 2 * kBlockColumns, stride);
  if (kBlocks > 3) _tile_stored(3, out + 3 * kBlockColumns, stride);
}

// Two full row blocks against kBlocks (1 or 2) consecutive blocks (`b_first`, `step_stride` as in group_product):
// each B tile serves both A tiles (fewer tile loads per product than group_product, for larger batches). Stored
// to `out` (row stride kGroupColumns floats); prefetches as group_product.
template <int kBlocks>
inline void row_pair_product(const at::BFloat16* x, int64_t x_stride_bytes, const at::BFloat16* b_first,
                             int64_t step_stride, int64_t num_steps, float* out, const char*& prefetch,
                             int64_t prefetch_lines) {
  _tile_zero(0);
  _tile_zero(2);
  if (kBlocks > 1) {
    _tile_zero(1);
    _tile_zero(3);
  }
  const at::BFloat16* x_lower = x + kTileRows * x_stride_bytes / static_cast<int64_t>(sizeof(at::BFloat16));
  for (int64_t step = 0; step < num_steps; ++step) {
    const at::BFloat16* b = b_first + step * step_stride;
    for (int64_t line = 0; line < prefetch_lines; ++line) _mm_prefetch(prefetch + line * 64, _MM_HINT_T1);
    prefetch += prefetch_lines * 64;
    _tile_loadd(4, x + step * kStepDepth, x_stride_bytes);
    _tile_loadd(5, x_lower + step * kStepDepth, x_stride_bytes);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if (kBlocks > 1) {
      _tile_loadd(7, b + kTileElements, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t stride = kGroupColumns * sizeof(float);
  float* lower = out + kTileRows * kGroupColumns;
  _tile_stored(0, out, stride);
  _tile_stored(2, lower, stride);
  if (kBlocks > 1) {
    _tile_stored(1, out + kBlockColumns, stride);
    _tile_stored(3, lower + kBlockColumns, stride);
  }
}

// The AMX unit (tiles 0-3 C, 4-5 A, 6-7 B; configured per thread as the row count changes).
struct AmxProducts {
  int64_t configured_rows = 0;  // this thread's tile configuration (0: none yet)

  void configure(int64_t rows) {
    if (rows != configured_rows) {
      configure_tiles(rows);
      configured_rows = rows;
    }
  }

  // The passes over a unit's weights that `rows` rows of x take (row pairs count as two, as before they existed:
  // the prefetch share of each pass is what keeps the memory busy).
  static int64_t num_passes(int64_t rows) { return ceil_div(rows, kTileRows); }
  // Bytes of a streaming share run_units prefetches before the first unit (none: the AMX loops were tuned on Intel
  // without it; the AMX path has not run since).
  static constexpr int64_t kStartPrefetchBytes = 0;
  // Products of few rows take the tiles too (run_units): no weight streams.
  static constexpr int kMaxStreams = 0;
  static constexpr int num_streams(int64_t) { return 0; }
  void stream_groups(const at::BFloat16*, int64_t, int64_t, const at::BFloat16* const*, int, int64_t, float*,
                     const PartialStream&) {}

  // out[r * kGroupColumns + c] = x[r] . W column c for rows [0, rows) and the num_blocks blocks of one group from
  // b_first (a step's tiles step_stride elements apart). Rows are taken 32 at a time while 32 are left (two A tiles,
  // each B tile used by both), then 16 at a time.
  void product(const at::BFloat16* x, int64_t x_stride, int64_t rows, const at::BFloat16* b_first, int64_t num_blocks,
               int64_t step_stride, int64_t num_steps, float* out, const char*& prefetch, int64_t prefetch_lines) {
    const int64_t x_stride_bytes = x_stride * static_cast<int64_t>(sizeof(at::BFloat16));
    int64_t row = 0;
    for (; rows - row >= 2 * kTileRows; row += 2 * kTileRows) {
      configure(kTileRows);
      for (int64_t pair = 0; pair < num_blocks; pair += 2) {
        const at::BFloat16* b = b_first + pair * kTileElements;
        float* out_pair = out + row * kGroupColumns + pair * kBlockColumns;
        if (pair + 1 < num_blocks)
          row_pair_product<2>(x + row * x_stride, x_stride_bytes, b, step_stride, num_steps, out_pair, prefetch,
                              prefetch_lines);
        else
          row_pair_product<1>(x + row * x_stride, x_stride_bytes, b, step_stride, num_steps, out_pair, prefetch,
                              prefetch_lines);
      }
    }
    for (; row < rows; row += kTileRows) {
      configure(std::min(kTileRows, rows - row));
      const at::BFloat16* x_rows = x + row * x_stride;
      float* out_rows = out + row * kGroupColumns;
      switch (num_blocks) {
        case 4: group_product<4>(x_rows, x_stride_bytes, b_first, step_stride, num_steps, out_rows, prefetch,
                                 prefetch_lines); break;
        case 3: group_product<3>(x_rows, x_stride_bytes, b_first, step_stride, num_steps, out_rows, prefetch,
                                 prefetch_lines); break;
        case 2: group_product<2>(x_rows, x_stride_bytes, b_first, step_stride, num_steps, out_rows, prefetch,
                                 prefetch_lines); break;
        default: group_product<1>(x_rows, x_stride_bytes, b_first, step_stride, num_steps, out_rows, prefetch,
                                  prefetch_lines); break;
      }
    }
  }

  void finish() {
    if (configured_rows != 0) _tile_release();
    configured_rows = 0;
  }
};

#endif  // PAGEDSERVE_AMX

#if defined(PAGEDSERVE_DPBF16)

// The AVX512-BF16 unit: the same packed tiles read as vectors. A B tile row (one K pair of 16 columns) is one
// vector, and VDPBF16PS against a broadcast x pair adds that pair's products to 16 columns of one row, so a block of
// kRows rows x kBlocks blocks keeps kRows * kBlocks accumulators (at most 24) in registers, kBlocks loads and kRows
// broadcasts per kRows * kBlocks VDPBF16PS. Over SmolLM2-135M's 30 layers of linears, interleaved with oneDNN's
// packed bf16 GEMM on an AMD Zen 4 VM (benchmarks/amx_linear.py): 1.36-1.42x at 1 row (23-24 GB/s against 17 from
// DRAM), 1.1-1.15x at 4-64 rows, 1.05x at 256, 0.95-0.98x at 2048.
template <int kBlocks>
constexpr int dot_block_rows() { return kBlocks == 4 ? 6 : (kBlocks == 3 ? 8 : 12); }

// A streaming pass of up to kBlockMajorMaxRows rows (dot_rows) goes block by block (dot_block_major). On the Zen 4
// VM, a decode step's 121 products interleaved against the pair-major loop with the far prefetch: 1.10x at 2 rows,
// 1.11x at 4, 0.99x at 6.
constexpr int kBlockMajorMaxRows = 4;

// kRows rows of x against kGroups groups of kBlocks blocks, block by block: each block's 1 KiB of a step is read
// front to back, no software prefetch. Several groups are several weight streams in flight for the hardware
// prefetcher (run_units gives a one-row product's groups from separate stretches of a thread's share); they are
// interleaved line by line (each 64-byte K pair row of a block, then the same row of the next group's block), as
// the float32 one-row kernel interleaves its weight rows (small_batch_linear.cpp). On the Zen 4 VM, one row over the
// 121 products of a SmolLM2-135M decode step on the same buffers, interleaved over eight rounds: 1.12x reading each
// group's 4 KiB of a step before the next group's (three groups each way), and 1.14x with six groups; the LM head
// alone 31.4 GB/s against 28.3 (torch's sum over its bytes: ~30). Per lane the K pairs go in order (one accumulator
// per row and block of a group), so the results equal the pair-major loop's bitwise. Group g's row i goes to
// out + (g * kRows + i) * kGroupColumns.
//
// kPartialBlocks > 0 adds one more stream: the first kPartialBlocks blocks from `partial` (a group's tile of step 0,
// its steps `partial_step_stride` elements apart), row i to partial_out + i * kGroupColumns. It takes the partial
// group at a thread's share's end (or start) and a short last group, which would otherwise stream alone after the
// others (see run_group_streams).
template <int kBlocks, int kRows, int kGroups, int kPartialBlocks = 0>
inline void dot_block_major(const at::BFloat16* x, int64_t x_stride, const at::BFloat16* const* groups,
                            int64_t step_stride, int64_t num_steps, float* out, const at::BFloat16* partial = nullptr,
                            int64_t partial_step_stride = 0, float* partial_out = nullptr) {
  static_assert(kPartialBlocks < kBlocks, "a partial group holds fewer blocks than a whole one");
  constexpr int kPartialSlots = kPartialBlocks > 0 ? kPartialBlocks : 1;
  __m512 acc[kGroups][kRows][kBlocks];
  __m512 partial_acc[kRows][kPartialSlots];
#pragma GCC unroll 8
  for (int group = 0; group < kGroups; ++group)
#pragma GCC unroll 4
    for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 4
      for (int block = 0; block < kBlocks; ++block) acc[group][i][block] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 4
    for (int block = 0; block < kPartialSlots; ++block) partial_acc[i][block] = _mm512_setzero_ps();
  for (int64_t step = 0; step < num_steps; ++step) {
    const at::BFloat16* x_step = x + step * kStepDepth;
#pragma GCC unroll 4
    for (int block = 0; block < kBlocks; ++block) {
#pragma GCC unroll 16
      for (int pair = 0; pair < kStepDepth / 2; ++pair) {
        __m512bh broadcasts[kRows];
#pragma GCC unroll 4
        for (int i = 0; i < kRows; ++i) {
          int32_t x_pair;  // rows may start at any even or odd element: copied, not dereferenced as int32
          std::memcpy(&x_pair, x_step + i * x_stride + 2 * pair, sizeof(x_pair));
          broadcasts[i] = reinterpret_cast<__m512bh>(_mm512_set1_epi32(x_pair));
        }
#pragma GCC unroll 8
        for (int group = 0; group < kGroups; ++group) {
          const at::BFloat16* b = groups[group] + step * step_stride + block * kTileElements;
          const __m512bh column = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + pair * 2 * kBlockColumns));
#pragma GCC unroll 4
          for (int i = 0; i < kRows; ++i)
            acc[group][i][block] = _mm512_dpbf16_ps(acc[group][i][block], broadcasts[i], column);
        }
        if (block < kPartialBlocks) {  // constant once the block loop is unrolled
          const int slot = block < kPartialSlots ? block : 0;
          const at::BFloat16* b = partial + step * partial_step_stride + slot * kTileElements;
          const __m512bh column = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + pair * 2 * kBlockColumns));
#pragma GCC unroll 4
          for (int i = 0; i < kRows; ++i)
            partial_acc[i][slot] = _mm512_dpbf16_ps(partial_acc[i][slot], broadcasts[i], column);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int group = 0; group < kGroups; ++group)
#pragma GCC unroll 4
    for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 4
      for (int block = 0; block < kBlocks; ++block)
        _mm512_storeu_ps(out + (group * kRows + i) * kGroupColumns + block * kBlockColumns, acc[group][i][block]);
#pragma GCC unroll 4
  for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 4
    for (int block = 0; block < kPartialBlocks; ++block)
      _mm512_storeu_ps(partial_out + i * kGroupColumns + block * kBlockColumns, partial_acc[i][block]);
}

// Rows [0, kRows) of x against kBlocks blocks, over all K steps in order (one accumulator per 16 columns of a row:
// per lane, the K pairs in order, as TDPBF16PS sums them). Prefetches as group_product; `is_streaming` (one pass
// over the weights, the decode case) also prefetches each step's bytes kDotFarPrefetchBytes further on, or, up to
// kBlockMajorMaxRows rows, reads block by block instead (the same sums in the same order).
template <int kBlocks, int kRows>
inline void dot_rows(const at::BFloat16* x, int64_t x_stride, const at::BFloat16* b_first, int64_t step_stride,
                     int64_t num_steps, float* out, const char*& prefetch, int64_t prefetch_lines, bool is_streaming) {
  if constexpr (kRows <= kBlockMajorMaxRows) {
    if (is_streaming) {
      dot_block_major<kBlocks, kRows, 1>(x, x_stride, &b_first, step_stride, num_steps, out);
      return;
    }
  }
  __m512 acc[kRows][kBlocks];
#pragma GCC unroll 12
  for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 4
    for (int block = 0; block < kBlocks; ++block) acc[i][block] = _mm512_setzero_ps();
  for (int64_t step = 0; step < num_steps; ++step) {
    const at::BFloat16* b = b_first + step * step_stride;
    for (int64_t line = 0; line < prefetch_lines; ++line) _mm_prefetch(prefetch + line * 64, _MM_HINT_T1);
    prefetch += prefetch_lines * 64;
    if (is_streaming) {
      const char* far = reinterpret_cast<const char*>(b) + kDotFarPrefetchBytes;
      for (int64_t line = 0; line < kBlocks * kTileElements * 2 / 64; ++line)
        _mm_prefetch(far + line * 64, _MM_HINT_T2);
    }
    const at::BFloat16* x_step = x + step * kStepDepth;
#pragma GCC unroll 16
    for (int pair = 0; pair < kStepDepth / 2; ++pair) {
      __m512i columns[kBlocks];
#pragma GCC unroll 4
      for (int block = 0; block < kBlocks; ++block)
        columns[block] = _mm512_loadu_si512(b + block * kTileElements + pair * 2 * kBlockColumns);
#pragma GCC unroll 12
      for (int i = 0; i < kRows; ++i) {
        int32_t x_pair;  // rows may start at any even or odd element: copied, not dereferenced as int32
        std::memcpy(&x_pair, x_step + i * x_stride + 2 * pair, sizeof(x_pair));
        const __m512bh broadcast = reinterpret_cast<__m512bh>(_mm512_set1_epi32(x_pair));
#pragma GCC unroll 4
        for (int block = 0; block < kBlocks; ++block)
          acc[i][block] = _mm512_dpbf16_ps(acc[i][block], broadcast, reinterpret_cast<__m512bh>(columns[block]));
      }
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 4
    for (int block = 0; block < kBlocks; ++block)
      _mm512_storeu_ps(out + i * kGroupColumns + block * kBlockColumns, acc[i][block]);
}

// The last rows - row (< kRows) rows of a dot_group, in one register block of that many rows.
template <int kBlocks, int kRows>
inline void dot_tail(const at::BFloat16* x, int64_t x_stride, int64_t rows, const at::BFloat16* b_first,
                     int64_t step_stride, int64_t num_steps, float* out, const char*& prefetch, int64_t prefetch_lines,
                     bool is_streaming) {
  if constexpr (kRows > 0) {
    if (rows == kRows)
      dot_rows<kBlocks, kRows>(x, x_stride, b_first, step_stride, num_steps, out, prefetch, prefetch_lines,
                               is_streaming);
    else
      dot_tail<kBlocks, kRows - 1>(x, x_stride, rows, b_first, step_stride, num_steps, out, prefetch, prefetch_lines,
                                   is_streaming);
  }
}

template <int kBlocks>
inline void dot_group(const at::BFloat16* x, int64_t x_stride, int64_t rows, const at::BFloat16* b_first,
                      int64_t step_stride, int64_t num_steps, float* out, const char*& prefetch,
                      int64_t prefetch_lines) {
  constexpr int kRows = dot_block_rows<kBlocks>();
  const bool is_streaming = prefetch_lines == 0 && rows <= kRows;
  int64_t row = 0;
  for (; rows - row >= kRows; row += kRows)
    dot_rows<kBlocks, kRows>(x + row * x_stride, x_stride, b_first, step_stride, num_steps, out + row * kGroupColumns,
                             prefetch, prefetch_lines, is_streaming);
  dot_tail<kBlocks, kRows - 1>(x + row * x_stride, x_stride, rows - row, b_first, step_stride, num_steps,
                               out + row * kGroupColumns, prefetch, prefetch_lines, is_streaming);
}

struct DotProducts {
  // The passes over a unit's weights (see AmxProducts); blocks of 6 rows at a full group.
  static int64_t num_passes(int64_t rows) { return ceil_div(rows, dot_block_rows<kGroupBlocks>()); }
  static constexpr int64_t kStartPrefetchBytes = kDotFarPrefetchBytes;  // see kDotFarPrefetchBytes
  // Weight streams of a product of up to 3 rows (run_units' whole groups, dot_block_major), no software prefetch. On
  // the Zen 4 VM, the 121 products of a SmolLM2-135M decode step on the same buffers, interleaved, at one row: three
  // streams, each group's 4 KiB of a step read before the next group's, 1.11-1.16x the one pair-major stream with the
  // far prefetch; the groups interleaved line by line, 3 / 4 / 5 / 6 streams 1.12 / 1.12 / 1.12 / 1.14x that (medians
  // of eight rounds). At 2 / 3 / 4 rows, two streams 1.06 / 1.03 / 1.02x one group at a time (1 / 2 / 3 streams at 2
  // rows: 1.05 / 1.06 / 1.05x); four rows keep one (two would hold 32 accumulators). One thread alone, one row:
  // pair-major (dot_rows<4, 1>: 4 lines 1 KiB apart at a time) 1.32x slower than block by block, 1.47x slower than
  // block by block over 2 groups.
  static constexpr int kMaxStreams = 6;
  static constexpr int kMaxStreamRows = 3;
  static constexpr int num_streams(int64_t rows) { return rows == 1 ? kMaxStreams : (rows <= kMaxStreamRows ? 2 : 0); }

  // Rows [0, rows) of x against `count` (<= num_streams(rows)) whole groups, group k's row i to
  // out + (k * rows + i) * kGroupColumns; at one row also against a partial group's first `partial.num_blocks`
  // (< kGroupBlocks, 0: none) blocks, to partial.out.
  void stream_groups(const at::BFloat16* x, int64_t x_stride, int64_t rows, const at::BFloat16* const* groups,
                     int count, int64_t num_steps, float* out, const PartialStream& partial) {
    static_assert(kMaxStreams == 6 && kMaxStreamRows == 3,
                  "stream_groups dispatches up to 6 groups at one row, 2 at 2-3 rows");
    constexpr int64_t kStride = kGroupBlocks * kTileElements;
    if (rows == 1) {
      switch (count) {
        case 6: one_row_streams<6>(x, x_stride, groups, num_steps, out, partial); break;
        case 5: one_row_streams<5>(x, x_stride, groups, num_steps, out, partial); break;
        case 4: one_row_streams<4>(x, x_stride, groups, num_steps, out, partial); break;
        case 3: one_row_streams<3>(x, x_stride, groups, num_steps, out, partial); break;
        case 2: one_row_streams<2>(x, x_stride, groups, num_steps, out, partial); break;
        default: one_row_streams<1>(x, x_stride, groups, num_steps, out, partial); break;
      }
    } else if (rows == 2) {
      if (count == 2) dot_block_major<kGroupBlocks, 2, 2>(x, x_stride, groups, kStride, num_steps, out);
      else dot_block_major<kGroupBlocks, 2, 1>(x, x_stride, groups, kStride, num_steps, out);
    } else {
      if (count == 2) dot_block_major<kGroupBlocks, 3, 2>(x, x_stride, groups, kStride, num_steps, out);
      else dot_block_major<kGroupBlocks, 3, 1>(x, x_stride, groups, kStride, num_steps, out);
    }
  }

  template <int kGroups>
  static void one_row_streams(const at::BFloat16* x, int64_t x_stride, const at::BFloat16* const* groups,
                              int64_t num_steps, float* out, const PartialStream& partial) {
    constexpr int64_t kStride = kGroupBlocks * kTileElements;
    static_assert(kGroupBlocks == 4, "one_row_streams dispatches partial groups of 1-3 blocks");
    switch (partial.num_blocks) {
      case 3:
        dot_block_major<kGroupBlocks, 1, kGroups, 3>(x, x_stride, groups, kStride, num_steps, out, partial.first,
                                                     partial.step_stride, partial.out);
        break;
      case 2:
        dot_block_major<kGroupBlocks, 1, kGroups, 2>(x, x_stride, groups, kStride, num_steps, out, partial.first,
                                                     partial.step_stride, partial.out);
        break;
      case 1:
        dot_block_major<kGroupBlocks, 1, kGroups, 1>(x, x_stride, groups, kStride, num_steps, out, partial.first,
                                                     partial.step_stride, partial.out);
        break;
      default: dot_block_major<kGroupBlocks, 1, kGroups>(x, x_stride, groups, kStride, num_steps, out); break;
    }
  }

  // As AmxProducts::product.
  void product(const at::BFloat16* x, int64_t x_stride, int64_t rows, const at::BFloat16* b_first, int64_t num_blocks,
               int64_t step_stride, int64_t num_steps, float* out, const char*& prefetch, int64_t prefetch_lines) {
    switch (num_blocks) {
      case 4: dot_group<4>(x, x_stride, rows, b_first, step_stride, num_steps, out, prefetch, prefetch_lines); break;
      case 3: dot_group<3>(x, x_stride, rows, b_first, step_stride, num_steps, out, prefetch, prefetch_lines); break;
      case 2: dot_group<2>(x, x_stride, rows, b_first, step_stride, num_steps, out, prefetch, prefetch_lines); break;
      default: dot_group<1>(x, x_stride, rows, b_first, step_stride, num_steps, out, prefetch, prefetch_lines); break;
    }
  }

  void finish() {}
};

#endif  // PAGEDSERVE_DPBF16

#if defined(PAGEDSERVE_FMA16) || defined(PAGEDSERVE_AVX2)

// The FMA units (no bf16 instructions): the same packed tiles read as vectors and widened to fp32 in registers, 16
// lanes on AVX-512 (the avx512 level: Skylake-SP, Cascade Lake, Ice Lake server) and 8 on AVX2. A B tile row (one
// K pair of 16 columns, 64 bytes) holds each column's (w[n][k], w[n][k + 1]) pair in one 32-bit lane, the even k in
// the low half: `pairs << 16` is the even-k weights as floats, `pairs & 0xFFFF0000` the odd-k ones (both exact: a
// bf16 is a float's upper half). Each is multiplied by x[k] (or x[k + 1]) broadcast from a row of x widened to fp32
// beforehand (widen_rows), FMA'd into one accumulator per row and FmaVectors::kLanes columns: per lane, the k of
// the unit in order (a pair's even k, then its odd k), as one chain. A bf16 x bf16 product is exact in fp32 (8-bit
// significands), so each FMA rounds only the running sum, and both units compute every output bit for bit the same
// (the same chain, the same epilogue rounding).
//
// AVX2 has 16 ymm registers, so a register block holds at most 10 accumulators beside the weights and broadcasts:
// one row takes a whole group (8 accumulators), two rows two blocks (8), and 5 rows one block (10 accumulators, a
// block row's two vectors widened to four, and a row's two broadcasts: 16). Every accumulator takes two dependent
// FMAs per K pair, so 10 of them keep 20 FMAs in flight per 10 cycles of latency: what two FMA pipes of 4-5 cycles'
// latency (Haswell to Zen 3) need, where 8 would leave them 20% idle. On an AMD EPYC VM (AVX2, about 30 GFLOP/s of
// fp32 FMA per core) the register blocks of 3-6 rows all ran within 5% of that in L2 (one thread, 216 KiB of
// weights), one row at 24 and two at 28. AVX-512 has 32 zmm registers and a block row is one vector: up to 4 rows
// take a whole group (up to 16 accumulators and 8 widened weight vectors), 5-8 rows two blocks (up to 16
// accumulators, 4 weight vectors, two broadcasts): a block row's two widening instructions serve 2 x 8 FMAs, which
// share the two vector ports with them on Skylake-SP. A row block reads the group's weights once per set of blocks
// it takes (a pass, num_passes): from memory for the first row block, from L2 for the others. x is widened to fp32
// per row block (L1-resident at the K of small models).
#if defined(PAGEDSERVE_FMA16)
struct FmaVectors {
  using Vector = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kMaxRows = 8;  // rows of a register block (see above)
  static constexpr int blocks_per_pass(int64_t rows) { return rows <= 4 ? 4 : 2; }
  static Vector zero() { return _mm512_setzero_ps(); }
  static Vector broadcast(const float* value) { return _mm512_set1_ps(*value); }
  static Vector fmadd(Vector a, Vector b, Vector sum) { return _mm512_fmadd_ps(a, b, sum); }
  static void store(float* out, Vector v) { _mm512_storeu_ps(out, v); }
  // The even-k and odd-k weights of the kLanes columns' pairs at `pairs` (see above).
  static void widen_pairs(const at::BFloat16* pairs, Vector& even, Vector& odd) {
    const __m512i bits = _mm512_loadu_si512(pairs);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  }
};
#else
struct FmaVectors {
  using Vector = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kMaxRows = 5;
  static constexpr int blocks_per_pass(int64_t rows) { return rows == 1 ? 4 : (rows == 2 ? 2 : 1); }
  static Vector zero() { return _mm256_setzero_ps(); }
  static Vector broadcast(const float* value) { return _mm256_broadcast_ss(value); }
  static Vector fmadd(Vector a, Vector b, Vector sum) { return _mm256_fmadd_ps(a, b, sum); }
  static void store(float* out, Vector v) { _mm256_storeu_ps(out, v); }
  static void widen_pairs(const at::BFloat16* pairs, Vector& even, Vector& odd) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  }
};
#endif
constexpr int kFmaRows = FmaVectors::kMaxRows;
// The far prefetch distance of a one-row pass over the weights (see fma_rows). One thread streaming 128 MiB of
// weights at one row on the AMD EPYC VM (AVX2): 16 KiB 1.15-1.3x none, 8 KiB slower than none, 32 KiB between.
constexpr int64_t kFmaFarPrefetchBytes = 16 * 1024;

// Blocks of a group one register block of `rows` (<= kFmaRows) rows takes at once (see FmaProducts).
constexpr int fma_blocks_per_pass(int64_t rows) { return FmaVectors::blocks_per_pass(rows); }

// kRows rows of fp32 x in widen_rows' layout (step by step, a step's kRows rows of kStepDepth values one after the
// other) against kBlocks consecutive blocks (b_first, step_stride as in group_product), over all K steps: out[i * kGroupColumns + c] for row i and column c of
// the blocks. A step goes K pair by K pair, each pair's row of every block in turn: every accumulator takes two
// dependent FMAs per pair, so the pair's 2 * kRows * kBlocks * kPieces FMAs must be independent chains to hide the
// FMA latency (block by block, one row would keep 2 chains in flight: 3.9 GMAC/s on one core of the EPYC VM,
// L2-resident). Prefetches as group_product; `is_streaming` (one pass over the weights from memory) also prefetches
// each step's bytes kFmaFarPrefetchBytes further on.
template <int kRows, int kBlocks>
inline void fma_rows(const float* x, const at::BFloat16* b_first, int64_t step_stride,
                     int64_t num_steps, float* out, const char*& prefetch, int64_t prefetch_lines, bool is_streaming) {
  using Vector = FmaVectors::Vector;
  constexpr int kPieces = kBlockColumns / FmaVectors::kLanes;  // vectors per block row
  Vector acc[kRows][kBlocks * kPieces];
#pragma GCC unroll 8
  for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < kBlocks * kPieces; ++v) acc[i][v] = FmaVectors::zero();
  for (int64_t step = 0; step < num_steps; ++step) {
    const at::BFloat16* b = b_first + step * step_stride;
    for (int64_t line = 0; line < prefetch_lines; ++line) _mm_prefetch(prefetch + line * 64, _MM_HINT_T1);
    prefetch += prefetch_lines * 64;
    if (is_streaming) {
      const char* far = reinterpret_cast<const char*>(b) + kFmaFarPrefetchBytes;
      for (int64_t line = 0; line < kBlocks * kTileElements * 2 / 64; ++line)
        _mm_prefetch(far + line * 64, _MM_HINT_T2);
    }
    const float* x_step = x + step * kRows * kStepDepth;  // every broadcast below at a constant offset from it
#pragma GCC unroll 16
    for (int pair = 0; pair < kStepDepth / 2; ++pair) {
#pragma GCC unroll 4
      for (int block = 0; block < kBlocks; ++block) {
        const at::BFloat16* row = b + block * kTileElements + pair * 2 * kBlockColumns;
        Vector even[kPieces], odd[kPieces];
#pragma GCC unroll 2
        for (int piece = 0; piece < kPieces; ++piece)
          FmaVectors::widen_pairs(row + piece * 2 * FmaVectors::kLanes, even[piece], odd[piece]);
#pragma GCC unroll 8
        for (int i = 0; i < kRows; ++i) {
          const Vector x_even = FmaVectors::broadcast(x_step + i * kStepDepth + 2 * pair);
          const Vector x_odd = FmaVectors::broadcast(x_step + i * kStepDepth + 2 * pair + 1);
#pragma GCC unroll 2
          for (int piece = 0; piece < kPieces; ++piece) {
            Vector& sum = acc[i][block * kPieces + piece];
            sum = FmaVectors::fmadd(even[piece], x_even, sum);
            sum = FmaVectors::fmadd(odd[piece], x_odd, sum);
          }
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < kBlocks * kPieces; ++v)
      FmaVectors::store(out + i * kGroupColumns + v * FmaVectors::kLanes, acc[i][v]);
}

// kRows rows of fp32 x (widen_rows' layout) against the num_blocks blocks of a group, fma_blocks_per_pass(kRows) blocks at a time.
template <int kRows>
inline void fma_group(const float* x, const at::BFloat16* b_first, int64_t num_blocks,
                      int64_t step_stride, int64_t num_steps, float* out, const char*& prefetch,
                      int64_t prefetch_lines, bool is_streaming) {
  constexpr int kBlocks = fma_blocks_per_pass(kRows);
  int64_t block = 0;
  for (; num_blocks - block >= kBlocks; block += kBlocks)
    fma_rows<kRows, kBlocks>(x, b_first + block * kTileElements, step_stride, num_steps,
                             out + block * kBlockColumns, prefetch, prefetch_lines, is_streaming);
  const int64_t rest = num_blocks - block;  // < kBlocks <= 4
  if constexpr (kBlocks > 1) {
    const at::BFloat16* b = b_first + block * kTileElements;
    float* rest_out = out + block * kBlockColumns;
    if (rest == 3)
      fma_rows<kRows, (kBlocks > 3 ? 3 : 1)>(x, b, step_stride, num_steps, rest_out, prefetch,
                                             prefetch_lines, is_streaming);
    else if (rest == 2)
      fma_rows<kRows, (kBlocks > 2 ? 2 : 1)>(x, b, step_stride, num_steps, rest_out, prefetch,
                                             prefetch_lines, is_streaming);
    else if (rest == 1)
      fma_rows<kRows, 1>(x, b, step_stride, num_steps, rest_out, prefetch, prefetch_lines, is_streaming);
  }
}

// The last `rows` (< kRows) rows of a product, one register block of that many rows.
template <int kRows>
inline void fma_tail(const float* x, int64_t rows, const at::BFloat16* b_first, int64_t num_blocks,
                     int64_t step_stride, int64_t num_steps, float* out, const char*& prefetch, int64_t prefetch_lines,
                     bool is_streaming) {
  if constexpr (kRows > 0) {
    if (rows == kRows)
      fma_group<kRows>(x, b_first, num_blocks, step_stride, num_steps, out, prefetch, prefetch_lines,
                       is_streaming);
    else
      fma_tail<kRows - 1>(x, rows, b_first, num_blocks, step_stride, num_steps, out, prefetch,
                          prefetch_lines, is_streaming);
  }
}

struct FmaProducts {
  // The passes over a unit's weights (see AmxProducts): per register block of rows, one per set of blocks it takes
  // at once (a pass of one block over the steps prefetches a share of the next group per step like a whole one).
  static int64_t num_passes(int64_t rows) {
    const int64_t tail = rows % kFmaRows;
    return rows / kFmaRows * ceil_div(kGroupBlocks, fma_blocks_per_pass(kFmaRows)) +
           (tail == 0 ? 0 : ceil_div(kGroupBlocks, fma_blocks_per_pass(tail)));
  }
  static constexpr int64_t kStartPrefetchBytes = kFmaFarPrefetchBytes;  // see run_unit_range
  // No weight streams yet: products of few rows run group by group (run_unit_range).
  static constexpr int kMaxStreams = 0;
  static constexpr int num_streams(int64_t) { return 0; }
  void stream_groups(const at::BFloat16*, int64_t, int64_t, const at::BFloat16* const*, int, int64_t, float*,
                     const PartialStream&) {}

  // As AmxProducts::product, in register blocks of kFmaRows rows and a shorter last one.
  void product(const at::BFloat16* x, int64_t x_stride, int64_t rows, const at::BFloat16* b_first, int64_t num_blocks,
               int64_t step_stride, int64_t num_steps, float* out, const char*& prefetch, int64_t prefetch_lines) {
    const bool is_streaming = prefetch_lines == 0 && rows <= kFmaRows;
    const int64_t depth = num_steps * kStepDepth;
    for (int64_t row = 0; row < rows; row += kFmaRows) {
      const int64_t block_rows = std::min<int64_t>(kFmaRows, rows - row);
      const float* widened = widen_rows(x + row * x_stride, x_stride, block_rows, depth);
      float* block_out = out + row * kGroupColumns;
      if (block_rows == kFmaRows)
        fma_group<kFmaRows>(widened, b_first, num_blocks, step_stride, num_steps, block_out, prefetch,
                            prefetch_lines, is_streaming);
      else
        fma_tail<kFmaRows - 1>(widened, block_rows, b_first, num_blocks, step_stride, num_steps, block_out,
                               prefetch, prefetch_lines, is_streaming);
    }
  }

  void finish() {}

 private:
  // Rows [0, rows) of bf16 x (x_stride apart, `depth` elements each) widened to fp32 into `widened_`, step by step:
  // a step's `rows` rows of kStepDepth values one after the other, so that fma_rows finds every x value of a step at
  // a constant offset from one pointer (with one pointer per row, GCC spilled the row pointers of its unrolled
  // loop to the stack and reloaded them before the broadcasts). The rows widened last are kept: a product of one row block (decode sizes) widens its rows once for
  // all its groups (x does not change while a unit runs its units).
  const float* widen_rows(const at::BFloat16* x, int64_t x_stride, int64_t rows, int64_t depth) {
    if (x == widened_x_ && x_stride == widened_stride_ && rows == widened_rows_ && depth == widened_depth_)
      return widened_.data();
    if (static_cast<int64_t>(widened_.size()) < rows * depth) widened_.resize(rows * depth);
    widened_x_ = x;
    widened_stride_ = x_stride;
    widened_rows_ = rows;
    widened_depth_ = depth;
    for (int64_t row = 0; row < rows; ++row) {
      const uint16_t* source = reinterpret_cast<const uint16_t*>(x + row * x_stride);
      for (int64_t k = 0; k < depth; k += 8)
        pagedserve_native::store8(widened_.data() + (k / kStepDepth * rows + row) * kStepDepth + k % kStepDepth,
                                  pagedserve_native::load8(source + k));
    }
    return widened_.data();
  }

  std::vector<float> widened_;  // up to kFmaRows rows of x in fp32
  const at::BFloat16* widened_x_ = nullptr;  // the rows in widened_
  int64_t widened_stride_ = 0, widened_rows_ = 0, widened_depth_ = 0;
};

#endif  // PAGEDSERVE_FMA16 || PAGEDSERVE_AVX2

#if defined(PAGEDSERVE_PACKED_LINEAR)

// Runs `body(products)` with a fresh unit of the kind `kind` names (resolve_products' answer).
template <typename Body>
void with_products(const std::string& kind, Body&& body) {
#if defined(PAGEDSERVE_AMX)
  if (kind == kAmxProducts) {
    AmxProducts products;
    body(products);
    products.finish();
    return;
  }
#endif
#if defined(PAGEDSERVE_DPBF16)
  DotProducts products;
#else
  (void)kind;
  FmaProducts products;
#endif
  body(products);
}

// ---- Epilogues, in the build's vectors: AVX-512 (16 columns at a time) or AVX2 (8).
#if defined(PAGEDSERVE_DPBF16) || defined(PAGEDSERVE_FMA16)

// The bf16 bit patterns nearest to v's 16 lanes, ties to even. With AVX512-BF16, VCVTNEPS2BF16, which flushes
// subnormal values to zero (as TDPBF16PS flushes its own): an output below ~1.2e-38 in magnitude becomes 0 where
// at::BFloat16 would keep a subnormal. Without it (the avx512 level's FMA unit), c10::BFloat16's rounding
// (bfloat16_rounding.h: subnormals kept, NaN -> 0x7FC0), as the AVX2 unit rounds.
inline __m256i bfloat16_of(__m512 v) {
#if defined(PAGEDSERVE_DPBF16)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#else
  return _mm512_cvtepi32_epi16(pagedserve_native::bfloat16_bits(v));
#endif
}

// The lanes of a 16-column piece that hold one of the `remaining` columns left.
inline __mmask16 columns_mask(int64_t remaining) {
  return remaining >= kBlockColumns ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1u);
}

// y[0:count] = bf16(values + bias), 16 columns at a time, rounded by bfloat16_of.
inline void store_row(const float* values, const float* bias, int64_t count, at::BFloat16* y) {
  for (int64_t column = 0; column < count; column += kBlockColumns) {
    const __mmask16 mask = columns_mask(count - column);
    __m512 value = _mm512_maskz_loadu_ps(mask, values + column);
    if (bias != nullptr) value = _mm512_add_ps(value, _mm512_maskz_loadu_ps(mask, bias + column));
    _mm256_mask_storeu_epi16(y + column, mask, bfloat16_of(value));
  }
}

// amx_linear_first_argmax's running maxima of one row (AmxFirstArgmaxCall::State): the `count` columns of `values`
// (+ bias), rounded to bf16 as store_row rounds them, folded into `lane_max` / `lane_index` (16 lanes, lane l taking
// the columns first_column + l + 16 j) and `first_nan`. With `allowed_words` (the row's grammar bitmask,
// allowed_tokens.h) a disallowed column takes no part: neither its value nor its NaN (finish gives 0 when nothing
// above -inf is left, as the -inf-masked logits' first argmax does).
inline void update_lane_maxima(const float* values, const float* bias, int64_t first_column, int64_t count,
                               float* lane_max, int32_t* lane_index, int32_t& first_nan,
                               const int32_t* allowed_words) {
  const __m512i lane_offsets = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512 best = _mm512_loadu_ps(lane_max);
  __m512i best_index = _mm512_loadu_si512(lane_index);
  for (int64_t column = 0; column < count; column += kBlockColumns) {
    __mmask16 mask = columns_mask(count - column);
    if (allowed_words != nullptr)
      mask &= static_cast<__mmask16>(pagedserve_native::allowed_token_bits(allowed_words, first_column + column));
    __m512 value = _mm512_maskz_loadu_ps(mask, values + column);
    if (bias != nullptr) value = _mm512_add_ps(value, _mm512_maskz_loadu_ps(mask, bias + column));
    // The logit amx_linear would store: rounded to bf16 (store_row's instruction), widened exactly.
    value = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bfloat16_of(value)), 16));
    const __m512i column_index =
        _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(first_column + column)), lane_offsets);
    const __mmask16 is_nan = _mm512_mask_cmp_ps_mask(mask, value, value, _CMP_UNORD_Q);
    if (is_nan != 0)
      first_nan = std::min(first_nan, static_cast<int32_t>(first_column + column + __builtin_ctz(is_nan)));
    // is_better per lane (units come in any order): greater, or equal at a lower column.
    const __mmask16 is_taken = _mm512_mask_cmp_ps_mask(mask, value, best, _CMP_GT_OQ) |
                               (_mm512_mask_cmp_ps_mask(mask, value, best, _CMP_EQ_OQ) &
                                _mm512_cmplt_epi32_mask(column_index, best_index));
    best = _mm512_mask_mov_ps(best, is_taken, value);
    best_index = _mm512_mask_mov_epi32(best_index, is_taken, column_index);
  }
  _mm512_storeu_ps(lane_max, best);
  _mm512_storeu_si512(lane_index, best_index);
}

// amx_linear_silu_and_mul's outputs of one row and group pair: out[0:64] = round(round(silu(round(gate))) *
// round(up)) for gate / up = the 64 fp32 products (+ bias), with `silu_table` (bfloat16_silu_table()).
inline void store_silu_and_mul_row(const float* gate_values, const float* up_values, const float* gate_bias,
                                   const float* up_bias, uint16_t* out, const uint16_t* silu_table) {
  const int* table = reinterpret_cast<const int*>(silu_table);
  for (int64_t column = 0; column < kGroupColumns; column += kBlockColumns) {
    __m512 gate = _mm512_load_ps(gate_values + column);
    __m512 up = _mm512_load_ps(up_values + column);
    if (gate_bias != nullptr) {
      gate = _mm512_add_ps(gate, _mm512_loadu_ps(gate_bias + column));
      up = _mm512_add_ps(up, _mm512_loadu_ps(up_bias + column));
    }
    // The projection's rounding (store_row's), then the SiLU kernel's table and product, rounded as
    // at::BFloat16 (ties to even, NaN -> 0x7FC0, subnormals kept).
    const __m512i gate_bits = _mm512_cvtepu16_epi32(bfloat16_of(gate));
    const __m512 up_rounded = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bfloat16_of(up)), 16));
    const __m512 silu = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_i32gather_epi32(gate_bits, table, 2), 16));
    const __m512i rounded = pagedserve_native::bfloat16_bits(_mm512_mul_ps(silu, up_rounded));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + column), _mm512_cvtepi32_epi16(rounded));
  }
}

// The SiLU table store_silu_and_mul_row takes (elementwise.cpp's, which the unfused SiLU-and-mul gathers from).
inline const uint16_t* silu_table_of_build() { return pagedserve_native::bfloat16_silu_table(); }

#else  // PAGEDSERVE_AVX2

// y[0:count] = bf16(values + bias), 8 columns at a time, rounded as c10::BFloat16 rounds (ties to even, NaN ->
// 0x7FC0, subnormals kept: unlike the AVX512-BF16 form, a result below ~1.2e-38 in magnitude stays a subnormal).
inline void store_row(const float* values, const float* bias, int64_t count, at::BFloat16* y) {
  uint16_t* target = reinterpret_cast<uint16_t*>(y);
  for (int64_t column = 0; column < count; column += 8) {
    const int64_t left = count - column;
    __m256 value = pagedserve_native::load8_first(values + column, left);
    if (bias != nullptr) value = _mm256_add_ps(value, pagedserve_native::load8_first(bias + column, left));
    pagedserve_native::store8_first(target + column, value, left);
  }
}

// As the AVX-512 form (same lanes: lane l takes the columns first_column + l + 16 j), 8 columns at a time: a
// 16-column piece's first 8 columns go to lanes 0-7, the others to lanes 8-15 (first_column is a multiple of 16).
// The logits are rounded as this build's store_row rounds them.
inline void update_lane_maxima(const float* values, const float* bias, int64_t first_column, int64_t count,
                               float* lane_max, int32_t* lane_index, int32_t& first_nan,
                               const int32_t* allowed_words) {
  const __m256i lane_offsets = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  constexpr int kHalves = kArgmaxLanes / 8;
  __m256 best[kHalves];
  __m256i best_index[kHalves];
  for (int half = 0; half < kHalves; ++half) {
    best[half] = _mm256_loadu_ps(lane_max + 8 * half);
    best_index[half] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lane_index + 8 * half));
  }
  for (int64_t piece = 0; piece < count; piece += kArgmaxLanes) {
    for (int half = 0; half < kHalves; ++half) {
      const int64_t column = piece + 8 * half, left = count - column;
      if (left <= 0) break;
      __m256 value = pagedserve_native::load8_first(values + column, left);
      if (bias != nullptr) value = _mm256_add_ps(value, pagedserve_native::load8_first(bias + column, left));
      value = pagedserve_native::round_to_bfloat16(value);  // the logit amx_linear would store
      __m256 valid = _mm256_castsi256_ps(pagedserve_native::first_lanes_mask(std::min<int64_t>(left, 8)));
      if (allowed_words != nullptr) {  // lane l of the 8 allowed: bit l of the column's allowed bits
        const __m256i bits = _mm256_and_si256(
            _mm256_set1_epi32(static_cast<int32_t>(
                pagedserve_native::allowed_token_bits(allowed_words, first_column + column) & 0xFFu)),
            lane_bits);
        valid = _mm256_and_ps(valid, _mm256_castsi256_ps(_mm256_cmpeq_epi32(bits, lane_bits)));
      }
      const __m256i column_index =
          _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(first_column + column)), lane_offsets);
      const int is_nan = _mm256_movemask_ps(_mm256_and_ps(valid, _mm256_cmp_ps(value, value, _CMP_UNORD_Q)));
      if (is_nan != 0)
        first_nan = std::min(first_nan, static_cast<int32_t>(first_column + column + __builtin_ctz(is_nan)));
      // is_better per lane (units come in any order): greater, or equal at a lower column.
      const __m256 is_lower_column = _mm256_castsi256_ps(_mm256_cmpgt_epi32(best_index[half], column_index));
      const __m256 is_taken =
          _mm256_and_ps(valid, _mm256_or_ps(_mm256_cmp_ps(value, best[half], _CMP_GT_OQ),
                                            _mm256_and_ps(_mm256_cmp_ps(value, best[half], _CMP_EQ_OQ),
                                                          is_lower_column)));
      best[half] = _mm256_blendv_ps(best[half], value, is_taken);
      best_index[half] = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(best_index[half]), _mm256_castsi256_ps(column_index), is_taken));
    }
  }
  for (int half = 0; half < kHalves; ++half) {
    _mm256_storeu_ps(lane_max + 8 * half, best[half]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lane_index + 8 * half), best_index[half]);
  }
}

// As the AVX-512 form, by elementwise.cpp's AVX2 formula instead of a table (its AVX2 build has none): silu(g) =
// round(g / (1 + exp8(-g))) of the rounded gate g, exp8 the same function (vector_avx2.h), so the result is bitwise
// amx_linear followed by the native SiLU-and-mul kernel of this build.
inline void store_silu_and_mul_row(const float* gate_values, const float* up_values, const float* gate_bias,
                                   const float* up_bias, uint16_t* out, const uint16_t* silu_table) {
  (void)silu_table;
  using pagedserve_native::round_to_bfloat16;
  for (int64_t column = 0; column < kGroupColumns; column += 8) {
    __m256 gate = _mm256_load_ps(gate_values + column);
    __m256 up = _mm256_load_ps(up_values + column);
    if (gate_bias != nullptr) {
      gate = _mm256_add_ps(gate, _mm256_loadu_ps(gate_bias + column));
      up = _mm256_add_ps(up, _mm256_loadu_ps(up_bias + column));
    }
    gate = round_to_bfloat16(gate);  // the projection's rounding (store_row's)
    const __m256 denominator =
        _mm256_add_ps(_mm256_set1_ps(1.0f), pagedserve_native::exp8(_mm256_xor_ps(gate, _mm256_set1_ps(-0.0f))));
    const __m256 silu = round_to_bfloat16(_mm256_div_ps(gate, denominator));
    pagedserve_native::store8(out + column, _mm256_mul_ps(silu, round_to_bfloat16(up)));
  }
}

inline const uint16_t* silu_table_of_build() { return nullptr; }

#endif  // PAGEDSERVE_DPBF16 or PAGEDSERVE_FMA16 / PAGEDSERVE_AVX2

#endif  // PAGEDSERVE_PACKED_LINEAR

int64_t packed_numel(int64_t n, int64_t k) { return ceil_div(n, kBlockColumns) * ceil_div(k, kStepDepth) * kTileElements; }

at::Tensor amx_pack_weight(const at::Tensor& weight) {
  check_supported("amx_pack_weight");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "amx_pack_weight: a 2-D bfloat16 weight [N, K] expected, got ", weight.sizes(), " ",
              weight.scalar_type());
  const at::Tensor plain = weight.contiguous();
  const int64_t n = plain.size(0), k = plain.size(1);
  const int64_t num_blocks = ceil_div(n, kBlockColumns), num_steps = ceil_div(k, kStepDepth);
  at::Tensor packed = at::zeros({packed_numel(n, k)}, plain.options());
  const at::BFloat16* source = plain.data_ptr<at::BFloat16>();
  at::BFloat16* target = packed.data_ptr<at::BFloat16>();
  const int64_t num_groups = ceil_div(num_blocks, kGroupBlocks);
  at::parallel_for(0, num_groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t group = begin; group < end; ++group) {
      const int64_t first_block = group * kGroupBlocks;
      const int64_t group_blocks = std::min(kGroupBlocks, num_blocks - first_block);
      at::BFloat16* group_base = target + first_block * num_steps * kTileElements;
      for (int64_t step = 0; step < num_steps; ++step)
        for (int64_t block = 0; block < group_blocks; ++block) {
          at::BFloat16* tile = group_base + (step * group_blocks + block) * kTileElements;
          for (int64_t column = 0; column < kBlockColumns; ++column) {
            const int64_t row = (first_block + block) * kBlockColumns + column;
            if (row >= n) break;
            for (int64_t depth = 0; depth < kStepDepth; ++depth) {
              const int64_t col = step * kStepDepth + depth;
              if (col >= k) break;
              // VNNI order: tile row = K pair, then column, then the pair's element.
              tile[(depth / 2) * 2 * kBlockColumns + column * 2 + depth % 2] = source[row * k + col];
            }
          }
        }
    }
  });
  return packed;
}

at::Tensor amx_unpack_weight(const at::Tensor& packed, int64_t n, int64_t k) {
  check_supported("amx_unpack_weight");
  TORCH_CHECK(packed.dim() == 1 && packed.is_contiguous() && packed.numel() == packed_numel(n, k) &&
                  packed.scalar_type() == at::kBFloat16,
              "amx_unpack_weight: a packed bfloat16 weight of ", packed_numel(n, k), " values expected for [", n,
              ", ", k, "], got ", packed.sizes(), " ", packed.scalar_type());
  const int64_t num_blocks = ceil_div(n, kBlockColumns), num_steps = ceil_div(k, kStepDepth);
  at::Tensor plain = at::empty({n, k}, packed.options());
  const at::BFloat16* source = packed.data_ptr<at::BFloat16>();
  at::BFloat16* target = plain.data_ptr<at::BFloat16>();
  for (int64_t row = 0; row < n; ++row) {
    const int64_t block = row / kBlockColumns, column = row % kBlockColumns;
    const int64_t group = block / kGroupBlocks, first_block = group * kGroupBlocks;
    const int64_t group_blocks = std::min(kGroupBlocks, num_blocks - first_block);
    const at::BFloat16* group_base = source + first_block * num_steps * kTileElements;
    for (int64_t col = 0; col < k; ++col) {
      const int64_t step = col / kStepDepth, depth = col % kStepDepth;
      const at::BFloat16* tile = group_base + (step * group_blocks + (block - first_block)) * kTileElements;
      target[row * k + col] = tile[(depth / 2) * 2 * kBlockColumns + column * 2 + depth % 2];
    }
  }
  return plain;
}

// One product x[M, K] @ W[N, K]^T in the kernel's terms, for run_units.
struct PackedProduct {
  const at::BFloat16* x;   // [m, num_steps * kStepDepth] (zero-padded to whole steps), rows x_stride apart
  int64_t x_stride;        // elements
  const at::BFloat16* weight;  // packed by amx_pack_weight
  int64_t m, n, num_steps;
  int64_t panel_chunk_rows;    // rows of x per task above kChunkRows rows (panel_chunk_rows of the unit)
};

// Checks x and the packed weight of one amx_linear-family op and returns its product; a K that is not a multiple of
// 32 is read through a zero-padded copy of x, kept alive in `x_padded`.
PackedProduct packed_product(const char* op, const std::string& kind, const at::Tensor& x, const at::Tensor& packed,
                             int64_t n, at::Tensor& x_padded) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, op,
              ": x [M, K] bfloat16 with unit column stride expected, got ", x.sizes(), " ", x.scalar_type());
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(packed.dim() == 1 && packed.is_contiguous() && packed.numel() == packed_numel(n, k) &&
                  packed.scalar_type() == at::kBFloat16,
              op, ": the packed weight holds ", packed.numel(), " values; [", n, ", ", k, "] packs to ",
              packed_numel(n, k), " (a contiguous 1-D bfloat16 tensor from amx_pack_weight expected)");
  const int64_t num_steps = ceil_div(k, kStepDepth);
  x_padded = x;
  if (k % kStepDepth != 0) {
    x_padded = at::zeros({m, num_steps * kStepDepth}, x.options());
    x_padded.narrow(1, 0, k).copy_(x);
  }
  return {x_padded.data_ptr<at::BFloat16>(), x_padded.stride(0), packed.data_ptr<at::BFloat16>(), m, n, num_steps,
          panel_chunk_rows(kind)};
}

// The bias as fp32 (undefined without one), checked against n.
at::Tensor float_bias(const char* op, const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, op, ": a bias of ", n, " values expected, got ", bias->sizes());
  return bias->to(at::kFloat).contiguous();
}

// Work units of a product: (panel of blocks, chunk of rows, block of 16 columns), panel-major (see the header).
// Up to kChunkRows rows there is one panel and one chunk: the threads split the weight stream block by block while x
// stays in L2.
int64_t num_units(const PackedProduct& p) {
  return ceil_div(p.m, p.m > kChunkRows ? p.panel_chunk_rows : kChunkRows) * ceil_div(p.n, kBlockColumns);
}

#if defined(PAGEDSERVE_PACKED_LINEAR)

// Units [begin, end) of `p` one at a time (run_units).
template <typename Products, typename Epilogue>
void run_unit_range(Products& products, const PackedProduct& p, int64_t begin, int64_t end, Epilogue&& epilogue) {
  const int64_t m = p.m, n = p.n, num_steps = p.num_steps;
  const int64_t num_blocks = ceil_div(n, kBlockColumns);
  const bool is_paneled = m > kChunkRows;
  const int64_t chunk_rows_max = is_paneled ? p.panel_chunk_rows : kChunkRows;
  const int64_t num_chunks = ceil_div(m, chunk_rows_max);
  const int64_t group_bytes = kGroupBlocks * num_steps * kTileElements * static_cast<int64_t>(sizeof(at::BFloat16));
  const int64_t panel_blocks =
      is_paneled ? std::min(num_blocks, std::max<int64_t>(1, kPanelWeightBytes / group_bytes) * kGroupBlocks)
                 : num_blocks;
  const int64_t units_per_panel = num_chunks * panel_blocks;  // the last panel may hold fewer blocks
  // One chunk's results for up to one group of blocks, before bias and rounding (64 KiB).
  alignas(64) float out[kChunkRows * kGroupColumns];
  if (Products::kStartPrefetchBytes > 0 && !is_paneled && Products::num_passes(m) == 1 && begin < end) {
    // One pass over this thread's share of the weights: its first bytes, from its first block on (a group's
    // steps follow each other, so they lie ahead of that block in memory).
    const int64_t block = begin % num_blocks, group_first_block = block / kGroupBlocks * kGroupBlocks;
    const char* start = reinterpret_cast<const char*>(p.weight + group_first_block * num_steps * kTileElements +
                                                      (block - group_first_block) * kTileElements);
    const char* stop = reinterpret_cast<const char*>(p.weight + num_blocks * num_steps * kTileElements);
    const int64_t num_bytes = std::min<int64_t>(Products::kStartPrefetchBytes, stop - start);
    for (int64_t offset = 0; offset < num_bytes; offset += 64) _mm_prefetch(start + offset, _MM_HINT_T1);
  }
  for (int64_t unit = begin; unit < end;) {
    // This thread's blocks [first, last) of one group, for one chunk.
    const int64_t panel = unit / units_per_panel, in_panel = unit % units_per_panel;
    const int64_t panel_first_block = panel * panel_blocks;
    const int64_t num_panel_blocks = std::min(panel_blocks, num_blocks - panel_first_block);
    const int64_t chunk = in_panel / num_panel_blocks, block = panel_first_block + in_panel % num_panel_blocks;
    // Panels hold whole groups: a group never straddles two.
    const int64_t group_first_block = block / kGroupBlocks * kGroupBlocks;
    const int64_t group_blocks = std::min(kGroupBlocks, num_blocks - group_first_block);
    const int64_t first = block - group_first_block;
    const int64_t last = std::min(group_blocks, first + (end - unit));
    unit += last - first;
    const int64_t step_stride = group_blocks * kTileElements;
    const at::BFloat16* b_first = p.weight + group_first_block * num_steps * kTileElements + first * kTileElements;
    const int64_t first_column = (group_first_block + first) * kBlockColumns;
    const int64_t num_columns = std::min((last - first) * kBlockColumns, n - first_column);
    const int64_t chunk_begin = chunk * chunk_rows_max;
    const int64_t chunk_rows = std::min(m, chunk_begin + chunk_rows_max) - chunk_begin;
    const at::BFloat16* x_chunk = p.x + chunk_begin * p.x_stride;
    // The first row block (or pair) streams the blocks' weights from memory; the others find them in L2 and
    // would leave the memory idle, so every row block also prefetches its share of the bytes that follow (the
    // next group's weights, which this thread most likely reads next). Paneled, the panel is in L2 already:
    // prefetching into L1 would only evict the chunk's A tiles.
    const int64_t num_passes = Products::num_passes(chunk_rows);
    const int64_t prefetch_lines = (num_passes == 1 || is_paneled)
                                       ? 0
                                       : ceil_div(kGroupBlocks * kTileElements * 2 / 64, num_passes);
    const char* prefetch = reinterpret_cast<const char*>(b_first - first * kTileElements + num_steps * step_stride);
    products.product(x_chunk, p.x_stride, chunk_rows, b_first, last - first, step_stride, num_steps, out, prefetch,
                     prefetch_lines);
    epilogue(static_cast<const float*>(out), chunk_begin, chunk_rows, first_column, num_columns);
  }
}

// The whole groups [first_group, end_group) of a product of few rows, Products::num_streams(p.m) at a time: the
// groups are cut into that many stretches and each call takes the next group of every stretch. At one row the first
// call also streams the partial group of units [partial_begin, partial_end) (within one group; empty: none).
template <typename Products, typename Epilogue>
void run_group_streams(Products& products, const PackedProduct& p, int64_t first_group, int64_t end_group,
                       int64_t partial_begin, int64_t partial_end, Epilogue&& epilogue) {
  constexpr int kMaxStreams = Products::kMaxStreams;
  const int64_t num_groups = end_group - first_group;
  const int64_t stretch = ceil_div(num_groups, std::min<int64_t>(Products::num_streams(p.m), num_groups));
  const int64_t group_elements = kGroupBlocks * p.num_steps * kTileElements;
  alignas(64) float out[kMaxStreams * kGroupColumns];  // 6 groups at one row, or 2 groups of 2-3 rows
  static_assert(2 * Products::kMaxStreamRows <= kMaxStreams, "out holds num_streams(rows) * rows groups");
  alignas(64) float partial_out[kGroupColumns];
  PartialStream partial;
  int64_t partial_first_column = 0;
  if (partial_end > partial_begin) {
    const int64_t num_blocks = ceil_div(p.n, kBlockColumns);
    const int64_t group_first_block = partial_begin / kGroupBlocks * kGroupBlocks;
    const int64_t group_blocks = std::min(kGroupBlocks, num_blocks - group_first_block);
    const int64_t first = partial_begin - group_first_block;
    partial = PartialStream{p.weight + group_first_block * p.num_steps * kTileElements + first * kTileElements,
                            group_blocks * kTileElements, partial_end - partial_begin, partial_out};
    partial_first_column = partial_begin * kBlockColumns;
  }
  for (int64_t i = 0; i < stretch; ++i) {
    const at::BFloat16* groups[kMaxStreams];
    int64_t first_columns[kMaxStreams];
    int count = 0;
    for (int64_t group = first_group + i; group < end_group; group += stretch) {
      groups[count] = p.weight + group * group_elements;
      first_columns[count++] = group * kGroupColumns;
    }
    products.stream_groups(p.x, p.x_stride, p.m, groups, count, p.num_steps, out, i == 0 ? partial : PartialStream{});
    for (int k = 0; k < count; ++k)
      epilogue(static_cast<const float*>(out + k * p.m * kGroupColumns), 0, p.m, first_columns[k],
               std::min(kGroupColumns, p.n - first_columns[k]));
  }
  if (partial.num_blocks > 0)
    epilogue(static_cast<const float*>(partial_out), 0, p.m, partial_first_column,
             std::min(partial.num_blocks * kBlockColumns, p.n - partial_first_column));
}

// Computes units [begin, end) of `p` (one thread's share of parallel_for over num_units(p)) and hands each unit's
// fp32 products, before bias and rounding, to `epilogue(values, first_row, num_rows, first_column, num_columns)`:
// values[r * kGroupColumns + c] is row first_row + r, column first_column + c. The order of the units is not
// defined (products of up to 3 rows interleave stretches of groups): epilogues must not depend on it.
template <typename Products, typename Epilogue>
void run_units(Products& products, const PackedProduct& p, int64_t begin, int64_t end, Epilogue&& epilogue) {
  if constexpr (Products::kMaxStreams > 0) {
    if (Products::num_streams(p.m) > 0) {
      // Whole groups of four blocks stream. At one row, the partial group at the share's end (a short last group
      // included), or else the one at its start, streams beside them; at 2-3 rows, and the start's when both
      // are partial, they run alone (run_unit_range). Two threads of SmolLM2-135M's decode step each end or
      // start on half a group in three of a layer's four products (N = 960 and 576): streamed alone they took
      // ~10% of the layers' product time (perf) for ~5% of the bytes. Beside the others, the step's 121 products
      // on the same buffers ran 1.02x faster (median of eight interleaved rounds on the Zen 4 VM); same bits.
      const int64_t num_blocks = ceil_div(p.n, kBlockColumns);
      const int64_t first_group = ceil_div(begin, kGroupBlocks);
      const int64_t end_group = std::min(end, num_blocks) / kGroupBlocks;
      if (end_group > first_group) {
        const int64_t start_partial_end = first_group * kGroupBlocks, end_partial_begin = end_group * kGroupBlocks;
        int64_t partial_begin = 0, partial_end = 0;  // the partial group that streams
        if (p.m == 1 && end > end_partial_begin) {
          partial_begin = end_partial_begin;
          partial_end = end;
          end = end_partial_begin;
        } else if (p.m == 1 && start_partial_end > begin) {
          partial_begin = begin;
          partial_end = start_partial_end;
          begin = start_partial_end;
        }
        run_unit_range(products, p, begin, start_partial_end, epilogue);
        run_group_streams(products, p, first_group, end_group, partial_begin, partial_end, epilogue);
        run_unit_range(products, p, end_partial_begin, end, epilogue);
        return;
      }
    }
  }
  run_unit_range(products, p, begin, end, epilogue);
}

#endif  // PAGEDSERVE_PACKED_LINEAR

}  // namespace

namespace pagedserve_native {

struct AmxLinearCall::State {
  std::string kind;
  at::Tensor x_padded, bias_float, y;
  PackedProduct product;
};

AmxLinearCall::AmxLinearCall(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                             int64_t n, c10::string_view products, at::Tensor y)
    : state_(std::make_unique<State>()) {
  constexpr const char* op = "amx_linear";
  State& s = *state_;
  s.kind = resolve_products(op, products);
  s.product = packed_product(op, s.kind, x, packed, n, s.x_padded);
  s.bias_float = float_bias(op, bias, n);
  TORCH_CHECK(y.scalar_type() == at::kBFloat16 && y.is_contiguous() &&
                  y.sizes() == at::IntArrayRef({s.product.m, n}),
              op, ": the output must be a contiguous bfloat16 [", s.product.m, ", ", n, "] tensor, got ", y.sizes(),
              " ", y.scalar_type());
  s.y = std::move(y);
}

AmxLinearCall::~AmxLinearCall() = default;

int64_t AmxLinearCall::num_units() const {
  const PackedProduct& p = state_->product;
  return p.m == 0 || p.n == 0 ? 0 : ::num_units(p);
}

void AmxLinearCall::run_units(int64_t begin, int64_t end) const {
#if defined(PAGEDSERVE_PACKED_LINEAR)
  const State& s = *state_;
  const int64_t n = s.product.n;
  const float* bias_data = s.bias_float.defined() ? s.bias_float.data_ptr<float>() : nullptr;
  at::BFloat16* y_data = s.y.data_ptr<at::BFloat16>();
  with_products(s.kind, [&](auto& products) {
    ::run_units(products, s.product, begin, end,
                [&](const float* values, int64_t first_row, int64_t num_rows, int64_t first_column,
                    int64_t num_columns) {
                  for (int64_t row = 0; row < num_rows; ++row)
                    store_row(values + row * kGroupColumns, bias_data ? bias_data + first_column : nullptr,
                              num_columns, y_data + (first_row + row) * n + first_column);
                });
  });
#else
  (void)begin;
  (void)end;
#endif
}

}  // namespace pagedserve_native

namespace {

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      int64_t n, c10::string_view products) {
  TORCH_CHECK(x.dim() == 2, "amx_linear: x [M, K] bfloat16 with unit column stride expected, got ", x.sizes(), " ",
              x.scalar_type());
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  const pagedserve_native::AmxLinearCall call(x, packed, bias, n, products, y);
  at::parallel_for(0, call.num_units(), 1, [&](int64_t begin, int64_t end) { call.run_units(begin, end); });
  return y;
}

}  // namespace

namespace pagedserve_native {

// Greedy sampling straight from the LM head: out[i] = the first index of the maximum of row i of
// bf16(x @ W^T + b) over columns [0, num_columns) (a NaN counting as larger than everything, the first NaN winning;
// a row of -inf gives 0): exactly kernels/cpu/first_argmax.cpp on amx_linear's output narrowed to num_columns,
// without writing the [M, n] logits out and reading them back (at 64 rows and SmolLM2's 49152 columns the logits'
// write and the argmax pass took ~1.7 of ~7.2 ms). With `allowed` (structured outputs: each row's grammar bitmask,
// allowed_tokens.h) the disallowed columns count as -inf, as the masked logits' first argmax has them.
//
// Each unit's products are rounded to bf16 as store_row rounds them; every row of a slot keeps 16 lanes of (max,
// index) and its first NaN (the lowest column). A lane takes a value when it is greater, or equal at a lower column,
// so it holds its first maximum whatever order the units come in (run_units does not fix one) and whichever slots they
// go to; finish merges lanes and slots the same way.
struct AmxFirstArgmaxCall::State {
  std::string kind;
  at::Tensor x_padded, bias_float;
  PackedProduct product;
  int64_t num_columns = 0, num_slots = 0;
  // Structured outputs: row r's allowed tokens are the words at allowed + r * num_allowed_words (none: all).
  at::Tensor allowed_tensor;
  const int32_t* allowed = nullptr;
  int64_t num_allowed_words = 0;
  // [slot, row, lane] running maxima and their columns, [slot, row] first NaN columns; written by run_units of one
  // slot at a time (const State: shared between threads, each slot one thread's).
  std::vector<float> lane_max;
  std::vector<int32_t> lane_index, first_nan;
};

namespace {
constexpr int32_t kNoColumn = std::numeric_limits<int32_t>::max();
// Whether (value, column) beats the (maximum, index) kept so far: greater, or equal at a lower column (kNoColumn: no
// column yet). Order-independent, so lanes and slots merge in any order.
bool is_better(float value, int32_t column, float maximum, int32_t index) {
  return column != kNoColumn && (index == kNoColumn || value > maximum || (value == maximum && column < index));
}
}  // namespace

AmxFirstArgmaxCall::AmxFirstArgmaxCall(const at::Tensor& x, const at::Tensor& packed,
                                       const c10::optional<at::Tensor>& bias, int64_t n, int64_t num_columns,
                                       c10::string_view products, int64_t num_slots,
                                       const c10::optional<at::Tensor>& allowed)
    : state_(std::make_unique<State>()) {
  constexpr const char* op = "amx_linear_first_argmax";
  State& s = *state_;
  s.kind = resolve_products(op, products);
  s.product = packed_product(op, s.kind, x, packed, n, s.x_padded);
  s.bias_float = float_bias(op, bias, n);
  TORCH_CHECK(num_columns >= 1 && num_columns <= n, op, ": num_columns=", num_columns, " must be in [1, n=", n, "]");
  TORCH_CHECK(num_slots >= 1, op, ": num_slots=", num_slots, " must be >= 1");
  s.num_columns = num_columns;
  s.num_slots = num_slots;
  const int64_t m = s.product.m;
  if (allowed.has_value()) {
    pagedserve_native::check_allowed_tokens(op, *allowed, m, num_columns);
    s.allowed_tensor = *allowed;
    s.allowed = allowed->data_ptr<int32_t>();
    s.num_allowed_words = allowed->size(1);
  }
  s.lane_max.assign(num_slots * m * kArgmaxLanes, -std::numeric_limits<float>::infinity());
  s.lane_index.assign(num_slots * m * kArgmaxLanes, kNoColumn);
  s.first_nan.assign(num_slots * m, kNoColumn);
}

AmxFirstArgmaxCall::~AmxFirstArgmaxCall() = default;

bool AmxFirstArgmaxCall::copies_x(int64_t k) { return k % kStepDepth != 0; }

int64_t AmxFirstArgmaxCall::num_units() const {
  const PackedProduct& p = state_->product;
  return p.m == 0 || p.n == 0 ? 0 : ::num_units(p);
}

void AmxFirstArgmaxCall::run_units(int64_t begin, int64_t end, int64_t slot) const {
#if defined(PAGEDSERVE_PACKED_LINEAR)
  const State& s = *state_;
  const int64_t m = s.product.m, num_columns = s.num_columns;
  const float* bias_data = s.bias_float.defined() ? s.bias_float.data_ptr<float>() : nullptr;
  float* const lane_max = const_cast<float*>(s.lane_max.data()) + slot * m * kArgmaxLanes;
  int32_t* const lane_index = const_cast<int32_t*>(s.lane_index.data()) + slot * m * kArgmaxLanes;
  int32_t* const first_nan = const_cast<int32_t*>(s.first_nan.data()) + slot * m;
  with_products(s.kind, [&](auto& products) {
    ::run_units(products, s.product, begin, end,
                [&](const float* values, int64_t first_row, int64_t num_rows, int64_t first_column, int64_t count) {
                  count = std::min(count, num_columns - first_column);
                  for (int64_t row = 0; row < num_rows; ++row) {
                    const int64_t r = first_row + row;
                    update_lane_maxima(values + row * kGroupColumns, bias_data ? bias_data + first_column : nullptr,
                                       first_column, count, lane_max + r * kArgmaxLanes,
                                       lane_index + r * kArgmaxLanes, first_nan[r],
                                       s.allowed != nullptr ? s.allowed + r * s.num_allowed_words : nullptr);
                  }
                });
  });
#else
  (void)begin;
  (void)end;
  (void)slot;
#endif
}

void AmxFirstArgmaxCall::finish(int64_t* out) const {
  const State& s = *state_;
  const int64_t m = s.product.m;
  for (int64_t row = 0; row < m; ++row) {
    float maximum = -std::numeric_limits<float>::infinity();
    int32_t index = kNoColumn, nan_index = kNoColumn;
    for (int64_t slot = 0; slot < s.num_slots; ++slot) {
      nan_index = std::min(nan_index, s.first_nan[slot * m + row]);
      for (int64_t lane = 0; lane < kArgmaxLanes; ++lane) {
        const int64_t at = (slot * m + row) * kArgmaxLanes + lane;
        if (is_better(s.lane_max[at], s.lane_index[at], maximum, index)) {
          maximum = s.lane_max[at];
          index = s.lane_index[at];
        }
      }
    }
    // Every value -inf (or, with a grammar bitmask, every allowed one; or none allowed): the first column, as the
    // first argmax of a row of -inf (the masked row) gives.
    const bool is_all_minus_infinity = index == kNoColumn || maximum == -std::numeric_limits<float>::infinity();
    out[row] = nan_index != kNoColumn ? nan_index : (is_all_minus_infinity ? 0 : index);
  }
}

}  // namespace pagedserve_native

namespace {

// The op: AmxFirstArgmaxCall's units split by at::parallel_for, each of its calls into a slot of its own.
at::Tensor amx_linear_first_argmax(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                                   int64_t n, int64_t num_columns, c10::string_view products,
                                   const c10::optional<at::Tensor>& allowed) {
  const int64_t num_slots = std::max(1, at::get_num_threads());
  const pagedserve_native::AmxFirstArgmaxCall call(x, packed, bias, n, num_columns, products, num_slots, allowed);
  at::Tensor indices = at::zeros({x.size(0)}, x.options().dtype(at::kLong));
  if (call.num_units() == 0) return indices;
  // parallel_for calls its function at most once per thread (once when it runs inline).
  std::atomic<int64_t> next_slot{0};
  at::parallel_for(0, call.num_units(), 1, [&](int64_t begin, int64_t end) {
    const int64_t slot = next_slot.fetch_add(1);
    TORCH_CHECK(slot < num_slots, "amx_linear_first_argmax: more parallel_for calls than the ", num_slots,
                " threads");
    call.run_units(begin, end, slot);
  });
  call.finish(indices.data_ptr<int64_t>());
  return indices;
}

// silu(gate) * up straight from the gate_up projection: x [M, K] @ W[2d, K]^T gives gate = columns [0, d) and up =
// columns [d, 2d), and out [M, d] = round(round(silu(round(gate))) * round(up)), bitwise what amx_linear followed by
// the SiLU-and-mul kernel (kernels/cpu/elementwise.cpp: its bfloat16 table on AVX-512, its formula on AVX2) give,
// without writing the [M, 2d] projection out and reading it back. Needs d a multiple of 64 (whole groups) and K of
// 32.
//
// The units are those of amx_linear's paneled path, with a group pair in place of a block: (panel of group pairs,
// chunk of 32 rows, gate group p and its up group p + d / 64), panel-major, split evenly between the threads. A
// unit computes both groups' 32 x 64 results into L1 and writes 32 x 64 outputs. Interleaved with the unfused pair
// over 30 layers of SmolLM2's gate_up (3072 x 576): 1.17x at 2048 rows, 1.13x at 1024.
at::Tensor amx_linear_silu_and_mul(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                                   int64_t n, c10::string_view products) {
  constexpr const char* op = "amx_linear_silu_and_mul";
  const std::string kind = resolve_products(op, products);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, op,
              ": x [M, K] bfloat16 with unit column stride expected, got ", x.sizes(), " ", x.scalar_type());
  const int64_t m = x.size(0), k = x.size(1), d = n / 2;
  TORCH_CHECK(n % 2 == 0 && d % kGroupColumns == 0 && k % kStepDepth == 0, op, ": n=", n, " (2 x d, d a multiple of ",
              kGroupColumns, ") and K=", k, " (a multiple of ", kStepDepth, ") expected");
  TORCH_CHECK(packed.dim() == 1 && packed.is_contiguous() && packed.numel() == packed_numel(n, k) &&
                  packed.scalar_type() == at::kBFloat16,
              op, ": the packed weight holds ", packed.numel(), " values; [", n, ", ", k, "] packs to ",
              packed_numel(n, k), " (a contiguous 1-D bfloat16 tensor from amx_pack_weight expected)");
  at::Tensor bias_float;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, op, ": a bias of ", n, " values expected, got ", bias->sizes());
    bias_float = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({m, d}, x.options());
  if (m == 0 || d == 0) return out;
#if defined(PAGEDSERVE_PACKED_LINEAR)
  const int64_t num_steps = k / kStepDepth;
  const at::BFloat16* x_data = x.data_ptr<at::BFloat16>();
  const int64_t x_stride = x.stride(0);
  const at::BFloat16* weight = packed.data_ptr<at::BFloat16>();
  const float* bias_data = bias_float.defined() ? bias_float.data_ptr<float>() : nullptr;
  uint16_t* out_data = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const uint16_t* silu_table = silu_table_of_build();
  const int64_t num_pairs = d / kGroupColumns;
  const int64_t group_elements = kGroupBlocks * num_steps * kTileElements;
  const int64_t group_bytes = group_elements * static_cast<int64_t>(sizeof(at::BFloat16));
  const int64_t panel_pairs = std::min(num_pairs, std::max<int64_t>(1, kPanelWeightBytes / (2 * group_bytes)));
  const int64_t chunk_rows_max = panel_chunk_rows(kind);
  const int64_t num_chunks = ceil_div(m, chunk_rows_max);
  const int64_t units_per_panel = num_chunks * panel_pairs;  // the last panel may hold fewer pairs
  at::parallel_for(0, num_chunks * num_pairs, 1, [&](int64_t begin, int64_t end) {
    with_products(kind, [&](auto& products) {
      alignas(64) float results[2][kMaxPanelChunkRows * kGroupColumns];  // gate, up
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t panel = unit / units_per_panel, in_panel = unit % units_per_panel;
        const int64_t first_pair = panel * panel_pairs;
        const int64_t num_panel_pairs = std::min(panel_pairs, num_pairs - first_pair);
        const int64_t chunk = in_panel / num_panel_pairs, pair = first_pair + in_panel % num_panel_pairs;
        const int64_t chunk_begin = chunk * chunk_rows_max;
        const int64_t chunk_rows = std::min(m, chunk_begin + chunk_rows_max) - chunk_begin;
        const at::BFloat16* x_chunk = x_data + chunk_begin * x_stride;
        for (int64_t half = 0; half < 2; ++half) {
          const at::BFloat16* b_group = weight + (pair + half * num_pairs) * group_elements;
          constexpr int64_t step_stride = kGroupBlocks * kTileElements;
          float* result = results[half];
          const char* no_prefetch = nullptr;  // the panel is in L2 (see amx_linear's paneled path)
          products.product(x_chunk, x_stride, chunk_rows, b_group, kGroupBlocks, step_stride, num_steps, result,
                           no_prefetch, 0);
        }
        const float* gate_bias = bias_data ? bias_data + pair * kGroupColumns : nullptr;
        const float* up_bias = bias_data ? bias_data + d + pair * kGroupColumns : nullptr;
        for (int64_t row = 0; row < chunk_rows; ++row)
          store_silu_and_mul_row(results[0] + row * kGroupColumns, results[1] + row * kGroupColumns, gate_bias,
                                 up_bias, out_data + (chunk_begin + row) * d + pair * kGroupColumns, silu_table);
      }
    });
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("amx_pack_weight(Tensor weight) -> Tensor");
  m.def("amx_unpack_weight(Tensor packed, int n, int k) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias, int n, str products=\"auto\") -> Tensor");
  m.def("amx_linear_silu_and_mul(Tensor x, Tensor packed, Tensor? bias, int n, str products=\"auto\") -> "
        "Tensor");
  m.def("amx_linear_first_argmax(Tensor x, Tensor packed, Tensor? bias, int n, int num_columns, "
        "str products=\"auto\", Tensor? allowed=None) -> Tensor");
  // No tensor arguments to dispatch on: a catch-all kernel.
  m.def("is_amx_linear_supported() -> bool", &is_amx_linear_supported);
  m.def("amx_linear_products() -> str[]", &amx_linear_products);
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("amx_pack_weight", &amx_pack_weight);
  m.impl("amx_unpack_weight", &amx_unpack_weight);
  m.impl("amx_linear", &amx_linear);
  m.impl("amx_linear_silu_and_mul", &amx_linear_silu_and_mul);
  m.impl("amx_linear_first_argmax", &amx_linear_first_argmax);
}
