// Paged prefill attention for bfloat16 and float32: flash attention for the multi-token requests of a step, its two
// products on AMX tiles or on AVX512-BF16 dot products (VDPBF16PS) in bf16, on fp32 FMA in float32.
//
// Op: pagedserve::paged_prefill_attention(query [num_tokens, num_heads, head_dim] bf16 or fp32,
//       kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim] (the query's dtype),
//       block_table [num_requests, *] int32, seq_lens [num_requests] int32, query_start_loc [num_requests + 1] int32,
//       scale, sliding_window?, products = "auto")
//     -> out [num_tokens, num_heads, head_dim] (the query's dtype)
// `products` picks the unit: "amx" or "avx512_bf16" (bf16), "avx512_fp32" (fp32), or "auto" (fp32: avx512_fp32;
// bf16: AMX where the process may use it, else AVX512-BF16). The float32 unit is built with the bf16 ones (an
// AVX512-BF16 build). Op: pagedserve::prefill_attention_products() -> the units this build and process can use.
// Op: pagedserve::paged_prefill_attention_int8(query, kv_cache (int8 view of kv_cache_dtype="int8" pages), kv_scales
//       (their float32 scale view [2, num_blocks, block_size, num_kv_heads]), block_table, seq_lens, query_start_loc,
//       scale, sliding_window?, products = "auto"): the same kernel; phase 1 below reads the int8 rows and their
//       scales in place and dequantizes them into the packed tiles (Int8Rows), so the result is bitwise the op's on
//       the cache dequantized to the query's dtype. The packed tiles are the working buffers either way: nothing is
//       gathered first.
//
// Request r owns query rows [query_start_loc[r], query_start_loc[r + 1]): its last q_len tokens, at positions
// seq_len - q_len .. seq_len - 1, whose K/V are already in the cache (the step writes K/V first). Query position p
// sees context positions k <= p (and k > p - sliding_window with a window), read in place through the block table.
// Semantics are torch_paged's (_attend_request), which the tests use as the oracle.
//
// Why: ATen's CPU flash attention ran at ~0.15 TFLOPS in bf16 for SmolLM2's prompts (head_dim 64, 9 heads over 3
// KV heads, a few hundred tokens) on an AMX machine: 11% of an offline run; on an AVX512-BF16 machine without AMX
// (AMD Zen 4) it ran at ~0.05 TFLOPS: 15% of an offline run.
//
// Algorithm, per (request, KV head):
// 1. Pack once (phase 1, parallel): the visible keys, in chunks of 128 keys, as TDPBF16PS B tiles for S = Q K^T
//    (tile (chunk, key block of 16, dim step of 32): 16 rows of dim pairs x 16 keys) and the values as B tiles
//    for O = P V (tile (chunk, key step of 32, dim block of 16): 16 rows of key pairs x 16 dims). Keys past the
//    context are zero (finite) and masked.
// 2. Per tile of 16 query positions and each query head of the KV head's group (phase 2, parallel, longest items
//    first from a shared counter): for each 128-key chunk the tile can see, S (16 x 128 fp32, 64 keys per pass)
//    from the query tile; scale, mask, online softmax in fp32 (running max m, sum l); P rounded to bf16;
//    P V (16 x head_dim fp32) added to the fp32 accumulator rescaled by exp(m_old - m_new). Out = acc / l, rounded
//    to bf16 once. The tile's last chunk is cut at its last position rounded up to 32 keys: the keys past it are
//    hidden from every row (P exactly 0), so their products and softmax are skipped (7 prompts of 64-512 tokens:
//    3.77 -> 3.07 ms a call on AMX).
//    - AMX: S in 4 C tiles per pass; P V in 4 C tiles per 64 dims, added to the accumulator afterwards.
//    - AVX512-BF16: the same packed tiles read as vectors. A K tile row (a dim pair of 16 keys) is one 512-bit
//      vector, so S lanes are keys: 4 query rows x 4 key blocks of accumulators, a broadcast query dim pair per
//      row, no horizontal sums. A V tile row (a key pair of 16 dims) is one vector: 4 rows x 4 dim blocks, a
//      broadcast P key pair per row, accumulating straight into the rescaled accumulator.
//    - float32: the same register blocks on fp32 vectors: K packed as one vector of 16 keys per dim, V as plain
//      rows, P kept in fp32 (FloatProducts).
//
// Numerics: fp32 accumulation everywhere, P in bf16 for the second product in bf16 (as ATen's bf16 flash attention).
// A row's result depends only on its request and the unit (chunking is aligned on the request's context, sums run
// in key order): batch invariant and independent of the thread count, but not bitwise SDPA's, and the two units
// round their sums differently.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "amx_tiles.h"
#include "bfloat16_rounding.h"

namespace {

constexpr int64_t kTileRows = 16;     // query positions per tile (one A tile)
constexpr int64_t kKeyBlock = 16;     // keys per S C tile
constexpr int64_t kChunkKeys = 128;   // keys per softmax step: 8 S tiles; 4 K steps of the P V product
constexpr int64_t kChunkKeyBlocks = kChunkKeys / kKeyBlock;  // 8
constexpr int64_t kChunkKeySteps = kChunkKeys / 32;          // 4
constexpr int64_t kStep = 32;         // bf16 values per A-tile row (one TDPBF16PS K step)
constexpr int64_t kTileValues = 512;  // bf16 values per 1 KiB B tile
constexpr int64_t kMaxHeadDim = 256;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The dot-product unit's gate; AMX implies it (amx_tiles.h asks for AVX512-BF16 too).
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PAGEDSERVE_DPBF16 1
#endif

constexpr const char* kAmxProducts = "amx";
constexpr const char* kDotProducts = "avx512_bf16";
constexpr const char* kFloatProducts = "avx512_fp32";  // float32 inputs (FMA on fp32 vectors)

// bfloat16 units first (preferred first), then the float32 one.
std::vector<std::string> prefill_attention_products() {
  std::vector<std::string> units;
  if (pagedserve_native::is_amx_usable()) units.emplace_back(kAmxProducts);
#if defined(PAGEDSERVE_DPBF16)
  units.emplace_back(kDotProducts);
  units.emplace_back(kFloatProducts);
#endif
  return units;
}

bool is_prefill_attention_supported() { return !prefill_attention_products().empty(); }

#if defined(PAGEDSERVE_DPBF16)

using bf16 = at::BFloat16;

// One (request, KV head): where its visible keys start and where its packed keys and values live: per chunk,
// kChunkKeys * head_dim elements of each (bf16: kChunkKeyBlocks * (head_dim / 32) K tiles and kChunkKeySteps *
// (head_dim / 16) V tiles; float32: see FloatProducts).
template <typename Element>
struct Span {
  int64_t request;
  int64_t kv_head;
  int64_t first_key;   // absolute position of packed key 0
  int64_t num_chunks;  // of kChunkKeys keys
  Element* keys;
  Element* values;
};

// One tile of query positions of a span, all the group's query heads.
struct Item {
  int64_t span;
  int64_t tile;
  int64_t cost;  // chunks read, for ordering
};

// Where the pack phase reads one KV head's context rows (head_dim values each), by block id and offset in the block.
// PlainRows: the cache's own rows (the query's dtype). Int8Rows: int8 rows of kv_cache_dtype="int8" pages with their
// per-token-per-head float32 scales, dequantized into `scratch` on the way: q * scale in float32, then (bf16) rounded
// to nearest even as c10::BFloat16 does, so the packed values are bitwise kv_quantization.dequantize(..., dtype)'s and
// the kernel's result is bitwise its result on that dequantized cache. Each raises on a block id outside the cache.
template <typename Element>
struct PlainRows {
  const Element* keys;    // K plane, at the KV head's first element
  const Element* values;  // V plane, likewise
  int64_t block_stride;   // elements between blocks
  int64_t token_stride;   // elements between a block's tokens
  int64_t num_blocks;
  int64_t head_dim;

  PlainRows at_head(int64_t kv_head) const {
    PlainRows rows = *this;
    rows.keys += kv_head * head_dim;
    rows.values += kv_head * head_dim;
    return rows;
  }
  int64_t row(int64_t block, int64_t in_block) const {
    TORCH_CHECK(block >= 0 && block < num_blocks, "paged_prefill_attention: block id ", block, " is outside the cache "
                "(", num_blocks, " blocks)");
    return block * block_stride + in_block * token_stride;
  }
  const Element* key(int64_t block, int64_t in_block, Element*) const { return keys + row(block, in_block); }
  const Element* value(int64_t block, int64_t in_block, Element*) const { return values + row(block, in_block); }
};

// 16 int8 values times `scale`, in float32 (exact widening, one rounding: the reference's q.float() * scale).
inline __m512 dequantize_lanes(const int8_t* pointer, __m512 scale) {
  return _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pointer)))), scale);
}

inline void dequantize_row(const int8_t* row, float scale, int64_t head_dim, float* out) {
  const __m512 factor = _mm512_set1_ps(scale);
  for (int64_t dim = 0; dim < head_dim; dim += 16) _mm512_storeu_ps(out + dim, dequantize_lanes(row + dim, factor));
}

inline void dequantize_row(const int8_t* row, float scale, int64_t head_dim, bf16* out) {
  const __m512 factor = _mm512_set1_ps(scale);
  for (int64_t dim = 0; dim < head_dim; dim += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + dim),
                        _mm512_cvtepi32_epi16(pagedserve_native::bfloat16_bits(dequantize_lanes(row + dim, factor))));
}

template <typename Element>
struct Int8Rows {
  const int8_t* keys;  // K plane of the int8 view, at the KV head's first value
  const int8_t* values;
  const float* key_scales;  // K scales, at the KV head's scale
  const float* value_scales;
  int64_t block_stride;  // bytes between pages
  int64_t token_stride;  // bytes between a block's tokens
  int64_t scale_block_stride;  // floats between pages
  int64_t scale_token_stride;  // floats between a block's tokens
  int64_t num_blocks;
  int64_t head_dim;

  Int8Rows at_head(int64_t kv_head) const {
    Int8Rows rows = *this;
    rows.keys += kv_head * head_dim;
    rows.values += kv_head * head_dim;
    rows.key_scales += kv_head;
    rows.value_scales += kv_head;
    return rows;
  }
  void check(int64_t block) const {
    TORCH_CHECK(block >= 0 && block < num_blocks, "paged_prefill_attention_int8: block id ", block,
                " is outside the cache (", num_blocks, " blocks)");
  }
  const Element* key(int64_t block, int64_t in_block, Element* scratch) const {
    check(block);
    dequantize_row(keys + block * block_stride + in_block * token_stride,
                   key_scales[block * scale_block_stride + in_block * scale_token_stride], head_dim, scratch);
    return scratch;
  }
  const Element* value(int64_t block, int64_t in_block, Element* scratch) const {
    check(block);
    dequantize_row(values + block * block_stride + in_block * token_stride,
                   value_scales[block * scale_block_stride + in_block * scale_token_stride], head_dim, scratch);
    return scratch;
  }
};

// Packs keys [first_key, first_key + kChunkKeys * num_chunks) of one (request, KV head) as B tiles (see the
// header): K tile (chunk, key block, dim step) and V tile (chunk, key step, dim block), each chunk's tiles in that
// order. `rows` is at the KV head (PlainRows or Int8Rows).
template <typename Rows>
void pack_span(const Span<bf16>& span, const Rows& rows, const int32_t* block_row, int64_t seq_len, int64_t block_size,
               int64_t head_dim) {
  const int64_t dim_steps = head_dim / kStep, dim_blocks = head_dim / kKeyBlock;
  const int64_t num_keys = span.num_chunks * kChunkKeys;
  uint32_t* key_tiles = reinterpret_cast<uint32_t*>(span.keys);
  uint16_t* value_tiles = reinterpret_cast<uint16_t*>(span.values);
  alignas(64) bf16 key_scratch[kMaxHeadDim];
  alignas(64) bf16 value_scratch[kMaxHeadDim];
  for (int64_t key = 0; key < num_keys; ++key) {
    const int64_t chunk = key / kChunkKeys, in_chunk = key % kChunkKeys;
    const int64_t position = span.first_key + key;
    uint32_t* key_base = key_tiles + (chunk * kChunkKeyBlocks + in_chunk / kKeyBlock) * dim_steps * (kTileValues / 2) +
                         in_chunk % kKeyBlock;
    const int64_t value_step = in_chunk / kStep, pair_row = (in_chunk % kStep) / 2, parity = in_chunk % 2;
    uint16_t* value_base = value_tiles + (chunk * kChunkKeySteps + value_step) * dim_blocks * kTileValues +
                           pair_row * 32 + parity;
    if (position >= seq_len) {  // zero (finite) and masked out of the softmax
      for (int64_t pair = 0; pair < head_dim / 2; ++pair) key_base[(pair / 16) * (kTileValues / 2) + (pair % 16) * 16] = 0u;
      for (int64_t dim = 0; dim < head_dim; ++dim) value_base[(dim / 16) * kTileValues + (dim % 16) * 2] = 0;
      continue;
    }
    const int64_t block = block_row[position / block_size], in_block = position % block_size;
    const uint32_t* key_row = reinterpret_cast<const uint32_t*>(rows.key(block, in_block, key_scratch));
    const uint16_t* value_row = reinterpret_cast<const uint16_t*>(rows.value(block, in_block, value_scratch));
    // K tile row = a pair of dims, column = the key; V tile row = a pair of keys, column = the dim.
    for (int64_t pair = 0; pair < head_dim / 2; ++pair)
      key_base[(pair / 16) * (kTileValues / 2) + (pair % 16) * 16] = key_row[pair];
    for (int64_t dim = 0; dim < head_dim; ++dim) value_base[(dim / 16) * kTileValues + (dim % 16) * 2] = value_row[dim];
  }
}

#if defined(PAGEDSERVE_AMX)
// C tiles 2-5 += A (tile 0, from `a`, row stride `a_stride` bytes) x the four B tiles at b, b + b_stride, ...
// (1 KiB tiles, b_stride in bf16 values); tiles 6 and 7 alternate so that a load overlaps the previous product.
inline void four_products(const bf16* a, int64_t a_stride, const bf16* b, int64_t b_stride) {
  _tile_loadd(0, a, a_stride);
  _tile_loadd(6, b, 64);
  _tile_dpbf16ps(2, 0, 6);
  _tile_loadd(7, b + b_stride, 64);
  _tile_dpbf16ps(3, 0, 7);
  _tile_loadd(6, b + 2 * b_stride, 64);
  _tile_dpbf16ps(4, 0, 6);
  _tile_loadd(7, b + 3 * b_stride, 64);
  _tile_dpbf16ps(5, 0, 7);
}

inline void zero_four() {
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
}

// Stores C tiles 2-5 side by side: 16 rows x 64 fp32 columns from `out` (row stride `stride` bytes).
inline void store_four(float* out, int64_t stride) {
  _tile_stored(2, out, stride);
  _tile_stored(3, out + 16, stride);
  _tile_stored(4, out + 32, stride);
  _tile_stored(5, out + 48, stride);
}

// S[16 x kChunkKeys] = query_tile[16 x head_dim] . K chunk^T (fp32, row stride kChunkKeys), 64 keys per pass, for
// the chunk's first num_keys keys rounded up to 64 (the columns after them are left as they were).
inline void chunk_scores(const bf16* query_tile, const bf16* key_chunk, int64_t head_dim, int64_t num_keys,
                         float* scores) {
  const int64_t dim_steps = head_dim / kStep;
  for (int64_t first = 0; first * kKeyBlock < num_keys; first += 4) {
    const bf16* tiles = key_chunk + first * dim_steps * kTileValues;
    zero_four();
    for (int64_t step = 0; step < dim_steps; ++step)
      four_products(query_tile + step * kStep, head_dim * 2, tiles + step * kTileValues, dim_steps * kTileValues);
    store_four(scores + first * kKeyBlock, kChunkKeys * 4);
  }
}

// PV[16 x head_dim] = P[16 x kChunkKeys] (bf16, row stride kChunkKeys) . V chunk (fp32, row stride head_dim), over
// the chunk's first num_keys keys rounded up to 32 (P is zero past them).
inline void chunk_values(const bf16* probabilities, const bf16* value_chunk, int64_t head_dim, int64_t num_keys,
                         float* product) {
  const int64_t dim_blocks = head_dim / kKeyBlock;
  const int64_t num_steps = ceil_div(num_keys, kStep);
  for (int64_t first = 0; first < dim_blocks; first += 4) {
    zero_four();
    for (int64_t step = 0; step < num_steps; ++step)
      four_products(probabilities + step * kStep, kChunkKeys * 2,
                    value_chunk + (step * dim_blocks + first) * kTileValues, kTileValues);
    store_four(product + first * kKeyBlock, head_dim * 4);
  }
}

// The AMX unit: tiles 0 A (query or P rows), 2-5 C (S blocks, or 4 dim blocks of P V), 6-7 B.
struct AmxProducts {
  using Element = bf16;
  template <typename Rows>
  static void pack(const Span<bf16>& span, const Rows& rows, const int32_t* block_row, int64_t seq_len,
                   int64_t block_size, int64_t head_dim) {
    pack_span(span, rows, block_row, seq_len, block_size, head_dim);
  }
  static void begin_thread() { pagedserve_native::configure_tile_rows({16, 16, 16, 16, 16, 16, 16, 16}); }
  static void end_thread() { _tile_release(); }
  static void scores(const bf16* query_tile, const bf16* key_chunk, int64_t head_dim, int64_t num_keys,
                     float* scores) {
    chunk_scores(query_tile, key_chunk, head_dim, num_keys, scores);
  }
  // accumulator[r] = accumulator[r] * rescale[r] + P[r] . V over the chunk's first num_keys keys.
  static void values(const bf16* probabilities, const bf16* value_chunk, int64_t head_dim, int64_t num_keys,
                     const float* rescale, float* accumulator) {
    alignas(64) float product[kTileRows * kMaxHeadDim];
    chunk_values(probabilities, value_chunk, head_dim, num_keys, product);
    for (int64_t row = 0; row < kTileRows; ++row) {
      const __m512 factor = _mm512_set1_ps(rescale[row]);
      float* acc = accumulator + row * head_dim;
      const float* add = product + row * head_dim;
      for (int64_t dim = 0; dim < head_dim; dim += 16)
        _mm512_store_ps(acc + dim, _mm512_fmadd_ps(_mm512_load_ps(acc + dim), factor, _mm512_load_ps(add + dim)));
    }
  }
};
#endif  // PAGEDSERVE_AMX

// The vector units' register block: kBlockRows query or P rows x kBlockVectors key blocks (scores) or dim blocks
// (values) of 16 fp32 lanes.
constexpr int kBlockRows = 4;
constexpr int kBlockVectors = 4;
using RegisterBlock = __m512[kBlockRows][kBlockVectors];

// S rows [first_row, +kBlockRows) x key blocks [first_block, +kBlockVectors) (row stride kChunkKeys) from `sums`.
inline void store_scores(const RegisterBlock& sums, int64_t first_row, int64_t first_block, float* scores) {
  for (int r = 0; r < kBlockRows; ++r)
    for (int v = 0; v < kBlockVectors; ++v)
      _mm512_store_ps(scores + (first_row + r) * kChunkKeys + (first_block + v) * kKeyBlock, sums[r][v]);
}

// sums = accumulator rows [first_row, +kBlockRows) x dim blocks [first_dim_block, +kBlockVectors), each row scaled by
// its rescale factor (the online softmax's correction for everything before this chunk).
inline void load_rescaled(const float* accumulator, const float* rescale, int64_t first_row, int64_t first_dim_block,
                          int64_t head_dim, RegisterBlock& sums) {
  for (int r = 0; r < kBlockRows; ++r) {
    const __m512 factor = _mm512_set1_ps(rescale[first_row + r]);
    const float* acc = accumulator + (first_row + r) * head_dim + first_dim_block * kKeyBlock;
    for (int v = 0; v < kBlockVectors; ++v) sums[r][v] = _mm512_mul_ps(_mm512_load_ps(acc + v * kKeyBlock), factor);
  }
}

// The accumulator block load_rescaled read, written back from `sums`.
inline void store_accumulator(const RegisterBlock& sums, int64_t first_row, int64_t first_dim_block, int64_t head_dim,
                              float* accumulator) {
  for (int r = 0; r < kBlockRows; ++r) {
    float* acc = accumulator + (first_row + r) * head_dim + first_dim_block * kKeyBlock;
    for (int v = 0; v < kBlockVectors; ++v) _mm512_store_ps(acc + v * kKeyBlock, sums[r][v]);
  }
}

// The AVX512-BF16 unit: the packed tiles read as vectors (see the header). Blocks of 4 rows x 4 vectors keep 16
// accumulators in registers, 8 loads (4 of them broadcasts) per 16 VDPBF16PS.
struct DotProducts {
  using Element = bf16;
  template <typename Rows>
  static void pack(const Span<bf16>& span, const Rows& rows, const int32_t* block_row, int64_t seq_len,
                   int64_t block_size, int64_t head_dim) {
    pack_span(span, rows, block_row, seq_len, block_size, head_dim);
  }
  static constexpr int kRows = kBlockRows;
  static constexpr int kVectors = kBlockVectors;
  static void begin_thread() {}
  static void end_thread() {}

  // S (row stride kChunkKeys) for the chunk's first num_keys keys rounded up to 64, as AmxProducts.
  static void scores(const bf16* query_tile, const bf16* key_chunk, int64_t head_dim, int64_t num_keys,
                     float* scores) {
    const int64_t num_pairs = head_dim / 2;
    const int64_t block_values = num_pairs * 32;  // bf16 values per packed key block (16 keys)
    const uint32_t* query_pairs = reinterpret_cast<const uint32_t*>(query_tile);
    for (int64_t first_block = 0; first_block * kKeyBlock < num_keys; first_block += kVectors) {
      const bf16* blocks = key_chunk + first_block * block_values;
      for (int64_t first_row = 0; first_row < kTileRows; first_row += kRows) {
        RegisterBlock sums;
        for (int r = 0; r < kRows; ++r)
          for (int v = 0; v < kVectors; ++v) sums[r][v] = _mm512_setzero_ps();
        const uint32_t* rows = query_pairs + first_row * num_pairs;
        for (int64_t pair = 0; pair < num_pairs; ++pair) {
          __m512bh keys[kVectors];
          for (int v = 0; v < kVectors; ++v)
            keys[v] = reinterpret_cast<__m512bh>(_mm512_load_si512(blocks + v * block_values + pair * 32));
          for (int r = 0; r < kRows; ++r) {
            const __m512bh query =
                reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(rows[r * num_pairs + pair])));
            for (int v = 0; v < kVectors; ++v) sums[r][v] = _mm512_dpbf16_ps(sums[r][v], query, keys[v]);
          }
        }
        store_scores(sums, first_row, first_block, scores);
      }
    }
  }

  // accumulator[r] = accumulator[r] * rescale[r] + P[r] . V over the chunk's first num_keys keys (a multiple of 32).
  static void values(const bf16* probabilities, const bf16* value_chunk, int64_t head_dim, int64_t num_keys,
                     const float* rescale, float* accumulator) {
    const int64_t dim_blocks = head_dim / kKeyBlock;
    const int64_t num_key_pairs = num_keys / 2;
    const uint32_t* probability_pairs = reinterpret_cast<const uint32_t*>(probabilities);  // row stride 64 pairs
    for (int64_t first_dim_block = 0; first_dim_block < dim_blocks; first_dim_block += kVectors) {
      for (int64_t first_row = 0; first_row < kTileRows; first_row += kRows) {
        RegisterBlock sums;
        load_rescaled(accumulator, rescale, first_row, first_dim_block, head_dim, sums);
        const uint32_t* rows = probability_pairs + first_row * (kChunkKeys / 2);
        for (int64_t pair = 0; pair < num_key_pairs; ++pair) {
          // V tile (key step pair / 16, dim block), row pair % 16: this key pair's 16 dims.
          const bf16* tile_row =
              value_chunk + ((pair / 16) * dim_blocks + first_dim_block) * kTileValues + (pair % 16) * 32;
          __m512bh values[kVectors];
          for (int v = 0; v < kVectors; ++v)
            values[v] = reinterpret_cast<__m512bh>(_mm512_load_si512(tile_row + v * kTileValues));
          for (int r = 0; r < kRows; ++r) {
            const __m512bh p =
                reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(rows[r * (kChunkKeys / 2) + pair])));
            for (int v = 0; v < kVectors; ++v) sums[r][v] = _mm512_dpbf16_ps(sums[r][v], values[v], p);
          }
        }
        store_accumulator(sums, first_row, first_dim_block, head_dim, accumulator);
      }
    }
  }
};

// The float32 unit: keys packed per block of 16 keys as head_dim rows of 16 keys (one vector per dim), values as
// plain rows of head_dim (16 dims per vector); FMA against broadcast query dims and P values, in register blocks
// of 4 rows x 4 vectors as DotProducts. P stays in fp32.
struct FloatProducts {
  using Element = float;
  static constexpr int kRows = kBlockRows;
  static constexpr int kVectors = kBlockVectors;
  static void begin_thread() {}
  static void end_thread() {}

  // Keys [first_key, first_key + kChunkKeys * num_chunks) of one (request, KV head): K block (chunk, key block) =
  // head_dim x 16 keys, V = the keys' rows in order. Keys past the context are zero (finite) and masked. `rows` is
  // at the KV head (PlainRows or Int8Rows).
  template <typename Rows>
  static void pack(const Span<float>& span, const Rows& rows, const int32_t* block_row, int64_t seq_len,
                   int64_t block_size, int64_t head_dim) {
    const int64_t num_keys = span.num_chunks * kChunkKeys;
    alignas(64) float key_scratch[kMaxHeadDim];
    for (int64_t key = 0; key < num_keys; ++key) {
      const int64_t position = span.first_key + key;
      float* key_base = span.keys + (key / kKeyBlock) * head_dim * kKeyBlock + key % kKeyBlock;
      float* value_row = span.values + key * head_dim;
      if (position >= seq_len) {
        for (int64_t dim = 0; dim < head_dim; ++dim) key_base[dim * kKeyBlock] = 0.0f;
        std::memset(value_row, 0, head_dim * sizeof(float));
        continue;
      }
      const int64_t block = block_row[position / block_size], in_block = position % block_size;
      const float* key_row = rows.key(block, in_block, key_scratch);
      for (int64_t dim = 0; dim < head_dim; ++dim) key_base[dim * kKeyBlock] = key_row[dim];
      // An int8 row is dequantized straight into its packed place.
      const float* source = rows.value(block, in_block, value_row);
      if (source != value_row) std::memcpy(value_row, source, head_dim * sizeof(float));
    }
  }

  // S (row stride kChunkKeys) for the chunk's first num_keys keys rounded up to 64, as DotProducts.
  static void scores(const float* query_tile, const float* key_chunk, int64_t head_dim, int64_t num_keys,
                     float* scores) {
    const int64_t block_values = head_dim * kKeyBlock;
    for (int64_t first_block = 0; first_block * kKeyBlock < num_keys; first_block += kVectors) {
      const float* blocks = key_chunk + first_block * block_values;
      for (int64_t first_row = 0; first_row < kTileRows; first_row += kRows) {
        RegisterBlock sums;
        for (int r = 0; r < kRows; ++r)
          for (int v = 0; v < kVectors; ++v) sums[r][v] = _mm512_setzero_ps();
        const float* rows = query_tile + first_row * head_dim;
        for (int64_t dim = 0; dim < head_dim; ++dim) {
          __m512 keys[kVectors];
          for (int v = 0; v < kVectors; ++v) keys[v] = _mm512_load_ps(blocks + v * block_values + dim * kKeyBlock);
          for (int r = 0; r < kRows; ++r) {
            const __m512 query = _mm512_set1_ps(rows[r * head_dim + dim]);
            for (int v = 0; v < kVectors; ++v) sums[r][v] = _mm512_fmadd_ps(query, keys[v], sums[r][v]);
          }
        }
        store_scores(sums, first_row, first_block, scores);
      }
    }
  }

  // accumulator[r] = accumulator[r] * rescale[r] + P[r] . V over the chunk's first num_keys keys, as DotProducts.
  static void values(const float* probabilities, const float* value_chunk, int64_t head_dim, int64_t num_keys,
                     const float* rescale, float* accumulator) {
    const int64_t dim_blocks = head_dim / kKeyBlock;
    for (int64_t first_dim_block = 0; first_dim_block < dim_blocks; first_dim_block += kVectors) {
      for (int64_t first_row = 0; first_row < kTileRows; first_row += kRows) {
        RegisterBlock sums;
        load_rescaled(accumulator, rescale, first_row, first_dim_block, head_dim, sums);
        const float* rows = probabilities + first_row * kChunkKeys;
        for (int64_t key = 0; key < num_keys; ++key) {
          const float* value_row = value_chunk + key * head_dim + first_dim_block * kKeyBlock;
          __m512 values[kVectors];
          for (int v = 0; v < kVectors; ++v) values[v] = _mm512_load_ps(value_row + v * kKeyBlock);
          for (int r = 0; r < kRows; ++r) {
            const __m512 p = _mm512_set1_ps(rows[r * kChunkKeys + key]);
            for (int v = 0; v < kVectors; ++v) sums[r][v] = _mm512_fmadd_ps(p, values[v], sums[r][v]);
          }
        }
        store_accumulator(sums, first_row, first_dim_block, head_dim, accumulator);
      }
    }
  }
};

// 16 probabilities or outputs stored as the unit's element type: fp32 as is, bf16 rounded to nearest even.
inline void store_lanes(float* target, __m512 values) { _mm512_storeu_ps(target, values); }
inline void store_lanes(bf16* target, __m512 values) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(target), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(values)));
}

// exp(x) for x <= 0 as 2^(x log2 e): n = round, 2^f (|f| <= 1/2) by its degree-6 Taylor polynomial (relative error
// ~1e-7, far below the bf16 rounding P gets). x < -87 (masked keys: -inf) gives exactly 0.
inline __m512 softmax_exp(__m512 x) {
  // Below -87 the result would be subnormal (slow to compute): flushed to 0 instead.
  const __mmask16 is_zero = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~is_zero), _mm512_scalef_ps(p, n));
}

// The running state of one query tile: per row the max so far, 16 lanes of partial sums of exp, and the factor
// exp(old max - new max) that the chunk just scored applies to everything before it.
struct SoftmaxState {
  alignas(64) float row_max[kTileRows];
  alignas(64) float rescale[kTileRows];
  alignas(64) float row_sums[kTileRows * 16];
};

// Turns one chunk's raw scores (16 x kChunkKeys fp32, overwritten) into P (bf16, or fp32 for the float32 unit),
// updating `state`: scale, mask
// (row r sees keys k <= positions[r], and k > positions[r] - window), online softmax. Only the chunk's first
// num_keys keys (a multiple of 32) are read and written: the keys after them are hidden from every row, their P is
// zero and the value product skips them.
template <typename Element>
void chunk_softmax(float* scores, int64_t chunk_base, int64_t num_keys, const int64_t* positions, float scale,
                   std::optional<int64_t> sliding_window, SoftmaxState& state, Element* probabilities) {
  const int kParts = static_cast<int>(num_keys / 16);
  static_assert(kTileRows == 16, "the per-row state is handled as one 16-lane vector");
  const float negative_infinity = -std::numeric_limits<float>::infinity();
  const __m512 scale_vector = _mm512_set1_ps(scale);
  const __m512 masked = _mm512_set1_ps(negative_infinity);
  // Every row sees the whole chunk when its last key is at or before the first row and, with a window, its
  // first key is inside the last row's window.
  const bool is_whole = chunk_base + kChunkKeys - 1 <= positions[0] &&
                        (!sliding_window || chunk_base > positions[kTileRows - 1] - *sliding_window);
  // Pass 1, per row: scaled scores with hidden keys at -inf (written back), and the chunk's max.
  alignas(64) float chunk_max[kTileRows];
  for (int64_t row = 0; row < kTileRows; ++row) {
    float* s = scores + row * kChunkKeys;
    __m512 maximum = masked;
    if (is_whole) {
      for (int part = 0; part < kParts; ++part) {
        const __m512 v = _mm512_mul_ps(_mm512_load_ps(s + part * 16), scale_vector);
        _mm512_store_ps(s + part * 16, v);
        maximum = _mm512_max_ps(maximum, v);
      }
    } else {
      // Row `row` sees the chunk's keys [low, high).
      const int64_t position = positions[row];
      const int64_t high = std::min<int64_t>(kChunkKeys, position - chunk_base + 1);
      const int64_t low = sliding_window ? std::max<int64_t>(0, position - *sliding_window + 1 - chunk_base) : 0;
      for (int part = 0; part < kParts; ++part) {
        const int64_t begin = part * 16;
        const int64_t lo = std::clamp<int64_t>(low - begin, 0, 16), hi = std::clamp<int64_t>(high - begin, 0, 16);
        const __mmask16 visible = hi <= lo ? 0 : static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u));
        const __m512 v = _mm512_mask_mul_ps(masked, visible, _mm512_load_ps(s + begin), scale_vector);
        _mm512_store_ps(s + begin, v);
        maximum = _mm512_max_ps(maximum, v);
      }
    }
    chunk_max[row] = _mm512_reduce_max_ps(maximum);
  }
  // All rows at once: the new running max and the factor exp(old - new) for the state so far. A row that has
  // seen no key yet keeps max -inf and factor 1 (its state is zero); its first keys rescale it by exp(-inf) = 0.
  const __m512 old_max = _mm512_load_ps(state.row_max);
  const __m512 new_max = _mm512_max_ps(old_max, _mm512_load_ps(chunk_max));
  const __mmask16 is_unseen = _mm512_cmp_ps_mask(new_max, masked, _CMP_EQ_OQ);
  _mm512_store_ps(state.rescale, _mm512_mask_blend_ps(is_unseen, softmax_exp(_mm512_sub_ps(old_max, new_max)),
                                                      _mm512_set1_ps(1.0f)));
  _mm512_store_ps(state.row_max, new_max);
  // Pass 2, per row: P = exp(s - max) in bf16, and the running sums.
  for (int64_t row = 0; row < kTileRows; ++row) {
    const float* s = scores + row * kChunkKeys;
    Element* p = probabilities + row * kChunkKeys;
    // An unseen row's scores are all -inf: any finite shift gives P = 0.
    const __m512 shift = _mm512_set1_ps(state.row_max[row] == negative_infinity ? 0.0f : state.row_max[row]);
    __m512 sum = _mm512_mul_ps(_mm512_load_ps(state.row_sums + row * 16), _mm512_set1_ps(state.rescale[row]));
    for (int part = 0; part < kParts; ++part) {
      const __m512 e = softmax_exp(_mm512_sub_ps(_mm512_load_ps(s + part * 16), shift));
      sum = _mm512_add_ps(sum, e);
      store_lanes(p + part * 16, e);
    }
    _mm512_store_ps(state.row_sums + row * 16, sum);
  }
}

// One query head's tile of up to 16 positions (`positions[i]` absolute, rows past `num_rows` repeat the last) over
// the span's chunks [first_chunk, last_chunk]; writes rows [0, num_rows) to `out` (row stride out_stride).
//
// Software-pipelined for the AMX unit: the next chunk's scores are computed on the tiles between this chunk's
// softmax and its P V product. A tile load right after the vector stores of P waited for them to drain to L1 (12%
// of the kernel's samples sat on that first product); the next chunk's tile work now fills that wait. The
// dot-product unit has no such wait and takes the same order.
template <typename Products>
void attend_tile(const Span<typename Products::Element>& span, const typename Products::Element* query_tile,
                 const int64_t* positions, int64_t num_rows, int64_t first_chunk, int64_t last_chunk, int64_t head_dim,
                 float scale, std::optional<int64_t> sliding_window, typename Products::Element* out,
                 int64_t out_stride) {
  using Element = typename Products::Element;
  alignas(64) float scores[2][kTileRows * kChunkKeys];
  alignas(64) Element probabilities[kTileRows * kChunkKeys];
  alignas(64) float accumulator[kTileRows * kMaxHeadDim];
  SoftmaxState state;
  std::fill(state.row_max, state.row_max + kTileRows, -std::numeric_limits<float>::infinity());
  std::fill(state.row_sums, state.row_sums + kTileRows * 16, 0.0f);
  std::fill(accumulator, accumulator + kTileRows * head_dim, 0.0f);
  const int64_t key_chunk_values = kChunkKeys * head_dim, value_chunk_values = kChunkKeys * head_dim;
  const auto chunk_base = [&](int64_t chunk) { return span.first_key + chunk * kChunkKeys; };
  // The keys of a chunk that some row of the tile sees, from the chunk's start: all of them but in the last chunk,
  // which ends at the tile's last position (rounded up to 32 keys: a P V step). Causal tiles skip the products and
  // the softmax of the keys past it (~19% of the kernel's time on SmolLM2-sized prompts); their P is exactly zero.
  const auto visible_keys = [&](int64_t chunk) {
    return std::min(kChunkKeys, ceil_div(positions[kTileRows - 1] - chunk_base(chunk) + 1, kStep) * kStep);
  };
  Products::scores(query_tile, span.keys + first_chunk * key_chunk_values, head_dim, visible_keys(first_chunk),
                   scores[0]);
  chunk_softmax(scores[0], chunk_base(first_chunk), visible_keys(first_chunk), positions, scale, sliding_window, state,
                probabilities);
  for (int64_t chunk = first_chunk; chunk <= last_chunk; ++chunk) {
    float* next_scores = scores[(chunk - first_chunk + 1) % 2];
    if (chunk < last_chunk)
      Products::scores(query_tile, span.keys + (chunk + 1) * key_chunk_values, head_dim, visible_keys(chunk + 1),
                       next_scores);
    Products::values(probabilities, span.values + chunk * value_chunk_values, head_dim, visible_keys(chunk),
                     state.rescale, accumulator);
    if (chunk < last_chunk)
      chunk_softmax(next_scores, chunk_base(chunk + 1), visible_keys(chunk + 1), positions, scale, sliding_window,
                    state, probabilities);
  }
  for (int64_t row = 0; row < num_rows; ++row) {
    const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_load_ps(state.row_sums + row * 16)));
    const float* acc = accumulator + row * head_dim;
    Element* target = out + row * out_stride;
    for (int64_t dim = 0; dim < head_dim; dim += 16)
      store_lanes(target + dim, _mm512_mul_ps(_mm512_load_ps(acc + dim), inverse));
  }
}

// Phases 1 and 2 (see the header) on one product unit; the arguments are validated by the op.
// `rows` reads the cache (PlainRows over kv_cache, or Int8Rows over its int8 pages and scales).
template <typename Products, typename Rows>
void attend_prefills(const at::Tensor& query, const Rows& rows, int64_t block_size, int64_t num_kv_heads,
                     const at::Tensor& block_table,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                     std::optional<int64_t> sliding_window, at::Tensor& out) {
  using Element = typename Products::Element;
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_requests = seq_lens.size(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int64_t max_blocks = block_table.size(1);
  TORCH_CHECK(starts[0] == 0 && starts[num_requests] <= num_tokens, "paged_prefill_attention: query_start_loc "
              "must start at 0 and end at most at num_tokens=", num_tokens);
  // Spans and their packed tiles.
  const int64_t group = num_heads / num_kv_heads;
  const int64_t key_tile_values = kChunkKeys * head_dim, value_tile_values = kChunkKeys * head_dim;  // per chunk
  std::vector<Span<Element>> spans;
  std::vector<Item> items;
  int64_t total_chunks = 0;
  for (int64_t request = 0; request < num_requests; ++request) {
    const int64_t seq_len = lens[request], q_len = starts[request + 1] - starts[request];
    TORCH_CHECK(q_len >= 0 && q_len <= seq_len && ceil_div(seq_len, block_size) <= max_blocks,
                "paged_prefill_attention: request ", request, " has q_len=", q_len, ", seq_len=", seq_len,
                " (q_len <= seq_len and at most ", max_blocks * block_size, " tokens in its block table)");
    if (q_len == 0) continue;
    // Keys before the first query's window are never read (block-aligned, as torch_paged).
    const int64_t first_query = seq_len - q_len;
    const int64_t first_key =
        sliding_window ? std::max<int64_t>(0, first_query - *sliding_window + 1) / block_size * block_size : 0;
    const int64_t num_chunks = ceil_div(seq_len - first_key, kChunkKeys);
    for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
      const int64_t span_index = static_cast<int64_t>(spans.size());
      spans.push_back({request, kv_head, first_key, num_chunks, nullptr, nullptr});
      total_chunks += num_chunks;
      for (int64_t tile = 0; tile < ceil_div(q_len, kTileRows); ++tile) {
        const int64_t last_position = first_query + std::min(q_len, (tile + 1) * kTileRows) - 1;
        const int64_t first_position = first_query + tile * kTileRows;
        const int64_t low = sliding_window ? std::max<int64_t>(0, first_position - *sliding_window + 1 - first_key) : 0;
        items.push_back({span_index, tile, (last_position - first_key) / kChunkKeys - low / kChunkKeys + 1});
      }
    }
  }
  at::Tensor packed = at::empty({total_chunks * (key_tile_values + value_tile_values)}, query.options());
  Element* cursor = packed.data_ptr<Element>();
  for (Span<Element>& span : spans) {
    span.keys = cursor;
    cursor += span.num_chunks * key_tile_values;
    span.values = cursor;
    cursor += span.num_chunks * value_tile_values;
  }
  at::parallel_for(0, static_cast<int64_t>(spans.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const Span<Element>& span = spans[index];
      Products::pack(span, rows.at_head(span.kv_head), block_table.data_ptr<int32_t>() + span.request * max_blocks,
                     lens[span.request], block_size, head_dim);
    }
  });
  // Longest items first, taken from a shared counter: causal tiles differ in cost by up to the context length.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next_item{0};
  const Element* query_data = query.data_ptr<Element>();
  Element* out_data = out.data_ptr<Element>();
  const int64_t query_stride = query.stride(0), out_stride = num_heads * head_dim;
  const float scale_float = static_cast<float>(scale);
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Products::begin_thread();
    alignas(64) Element query_tile[kTileRows * kMaxHeadDim];
    int64_t positions[kTileRows];
    for (int64_t index = next_item.fetch_add(1); index < static_cast<int64_t>(items.size());
         index = next_item.fetch_add(1)) {
      const Item& item = items[index];
      const Span<Element>& span = spans[item.span];
      const int64_t seq_len = lens[span.request], row_begin = starts[span.request];
      const int64_t q_len = starts[span.request + 1] - row_begin;
      const int64_t first_row = item.tile * kTileRows;
      const int64_t num_rows = std::min(kTileRows, q_len - first_row);
      for (int64_t row = 0; row < kTileRows; ++row)
        positions[row] = seq_len - q_len + first_row + std::min(row, num_rows - 1);
      const int64_t last_chunk = (positions[kTileRows - 1] - span.first_key) / kChunkKeys;
      const int64_t first_chunk =
          sliding_window ? std::max<int64_t>(0, positions[0] - *sliding_window + 1 - span.first_key) / kChunkKeys : 0;
      for (int64_t member = 0; member < group; ++member) {
        const int64_t head = span.kv_head * group + member;
        for (int64_t row = 0; row < kTileRows; ++row)
          std::memcpy(query_tile + row * head_dim,
                      query_data + (row_begin + first_row + std::min(row, num_rows - 1)) * query_stride + head * head_dim,
                      head_dim * sizeof(Element));
        attend_tile<Products>(span, query_tile, positions, num_rows, first_chunk, last_chunk, head_dim, scale_float,
                    sliding_window, out_data + (row_begin + first_row) * out_stride + head * head_dim, out_stride);
      }
    }
    Products::end_thread();
  });
}

#endif  // PAGEDSERVE_DPBF16

// The checks both ops share (the query, the step's int32 inputs, the window, the unit) for a cache of
// [2, num_blocks, block_size, num_kv_heads, head_dim]; returns the unit that runs. `op` names the op in messages.
std::string check_prefill_inputs(const char* op, const at::Tensor& query, const at::Tensor& kv_cache,
                                 const at::Tensor& block_table, const at::Tensor& seq_lens,
                                 const at::Tensor& query_start_loc, std::optional<int64_t> sliding_window,
                                 const std::string& products) {
  TORCH_CHECK(is_prefill_attention_supported(), op, ": this build or process has neither AMX nor AVX512-BF16 "
              "(is_prefill_attention_supported() is False here)");
  const bool is_float = query.scalar_type() == at::kFloat;
  TORCH_CHECK(query.dim() == 3 && (query.scalar_type() == at::kBFloat16 || is_float) && query.stride(2) == 1 &&
                  query.stride(1) == query.size(2),
              op, ": query [num_tokens, num_heads, head_dim] bfloat16 or float32 with contiguous heads expected, got ",
              query.sizes(), " ", query.scalar_type(), " strides ", query.strides());
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  TORCH_CHECK(head_dim % 64 == 0 && head_dim <= kMaxHeadDim, op, ": head_dim=", head_dim,
              " must be a multiple of 64 up to ", kMaxHeadDim);
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.size(4) == head_dim, op,
              ": kv_cache [2, num_blocks, block_size, num_kv_heads, ", head_dim, "] expected, got ", kv_cache.sizes());
  const int64_t num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, op, ": num_heads=", num_heads,
              " must be a multiple of num_kv_heads=", num_kv_heads);
  const int64_t num_requests = seq_lens.size(0);
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  query_start_loc.dim() == 1 && query_start_loc.scalar_type() == at::kInt &&
                  query_start_loc.is_contiguous() && query_start_loc.size(0) == num_requests + 1 &&
                  block_table.dim() == 2 && block_table.scalar_type() == at::kInt && block_table.stride(1) == 1 &&
                  block_table.size(0) == num_requests,
              op, ": int32 seq_lens [R], query_start_loc [R + 1] and block_table [R, *] expected, got ",
              seq_lens.sizes(), ", ", query_start_loc.sizes(), ", ", block_table.sizes());
  TORCH_CHECK(!sliding_window.has_value() || *sliding_window >= 1, op, ": sliding_window=", *sliding_window,
              " must be >= 1");
  const std::vector<std::string> units = prefill_attention_products();
  TORCH_CHECK(products == "auto" || products == kAmxProducts || products == kDotProducts || products == kFloatProducts,
              op, ": products must be 'auto', 'amx', 'avx512_bf16' or 'avx512_fp32', got '", products, "'");
  const std::string unit = products != "auto" ? products : (is_float ? kFloatProducts : units.front());
  TORCH_CHECK(std::find(units.begin(), units.end(), unit) != units.end(), op, ": products='", products,
              "' is not available in this build or process (prefill_attention_products() lists what is)");
  TORCH_CHECK(is_float == (unit == kFloatProducts), op, ": products='", unit, "' takes ",
              is_float ? "bfloat16" : "float32", " inputs, got ", query.scalar_type(), " (float32 runs on '",
              kFloatProducts, "', bfloat16 on 'amx' or 'avx512_bf16')");
  return unit;
}

#if defined(PAGEDSERVE_DPBF16)
// Runs the unit `unit` over the cache rows that make_rows(element tag) gives.
template <typename MakeRows>
at::Tensor run_unit(const std::string& unit, const at::Tensor& query, MakeRows make_rows, int64_t block_size,
                    int64_t num_kv_heads, const at::Tensor& block_table, const at::Tensor& seq_lens,
                    const at::Tensor& query_start_loc, double scale, std::optional<int64_t> sliding_window) {
  at::Tensor out = at::empty(query.sizes(), query.options());
#if defined(PAGEDSERVE_AMX)
  if (unit == kAmxProducts) {
    attend_prefills<AmxProducts>(query, make_rows(bf16{}), block_size, num_kv_heads, block_table, seq_lens,
                                 query_start_loc, scale, sliding_window, out);
    return out;
  }
#endif
  if (unit == kFloatProducts)
    attend_prefills<FloatProducts>(query, make_rows(float{}), block_size, num_kv_heads, block_table, seq_lens,
                                   query_start_loc, scale, sliding_window, out);
  else
    attend_prefills<DotProducts>(query, make_rows(bf16{}), block_size, num_kv_heads, block_table, seq_lens,
                                 query_start_loc, scale, sliding_window, out);
  return out;
}
#endif  // PAGEDSERVE_DPBF16

at::Tensor paged_prefill_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                   const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                                   std::optional<int64_t> sliding_window, const std::string& products) {
  const char* op = "paged_prefill_attention";
  const std::string unit =
      check_prefill_inputs(op, query, kv_cache, block_table, seq_lens, query_start_loc, sliding_window, products);
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type() && kv_cache.is_contiguous(), op,
              ": a contiguous kv_cache [2, num_blocks, block_size, num_kv_heads, ", query.size(2),
              "] of the query's dtype (", query.scalar_type(), ") expected, got ", kv_cache.sizes(), " ",
              kv_cache.scalar_type());
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  const int64_t head_dim = kv_cache.size(4), token_stride = num_kv_heads * head_dim;
#if defined(PAGEDSERVE_DPBF16)
  const auto make_rows = [&](auto element) {
    using Element = decltype(element);
    const Element* cache = kv_cache.data_ptr<Element>();
    return PlainRows<Element>{cache, cache + kv_cache.stride(0), kv_cache.stride(1), token_stride, num_blocks,
                              head_dim};
  };
  return run_unit(unit, query, make_rows, block_size, num_kv_heads, block_table, seq_lens, query_start_loc, scale,
                  sliding_window);
#else
  return at::Tensor();  // unreachable: check_prefill_inputs raised
#endif
}

// The same attention over an int8 cache (kv_cache_dtype="int8": kv_quantization.py's pages): kv_cache the int8 view
// [2, num_blocks, block_size, num_kv_heads, head_dim] (rows contiguous within a page, pages and planes at any
// stride), kv_scales the float32 view [2, num_blocks, block_size, num_kv_heads] of the same pages. The pack phase
// reads the rows and their scales in place and dequantizes them into the unit's working buffers (Int8Rows); the
// rest is the kernel above, so the result is bitwise paged_prefill_attention's on the cache dequantized to the
// query's dtype (kv_quantization.dequantize_kv_cache).
at::Tensor paged_prefill_attention_int8(const at::Tensor& query, const at::Tensor& kv_cache,
                                        const at::Tensor& kv_scales, const at::Tensor& block_table,
                                        const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                                        std::optional<int64_t> sliding_window, const std::string& products) {
  const char* op = "paged_prefill_attention_int8";
  const std::string unit =
      check_prefill_inputs(op, query, kv_cache, block_table, seq_lens, query_start_loc, sliding_window, products);
  TORCH_CHECK(kv_cache.scalar_type() == at::kChar && kv_cache.stride(4) == 1 &&
                  kv_cache.stride(3) == kv_cache.size(4) && kv_cache.stride(2) == kv_cache.size(3) * kv_cache.size(4),
              op, ": kv_cache must be an int8 [2, num_blocks, block_size, num_kv_heads, head_dim] view with "
              "contiguous blocks, got ", kv_cache.scalar_type(), " strides ", kv_cache.strides());
  TORCH_CHECK(kv_scales.scalar_type() == at::kFloat && kv_scales.dim() == 4 &&
                  kv_scales.sizes() == kv_cache.sizes().slice(0, 4) && kv_scales.stride(3) == 1,
              op, ": kv_scales must be a float32 [2, num_blocks, block_size, num_kv_heads] view with contiguous heads, "
              "got ", kv_scales.scalar_type(), " ", kv_scales.sizes());
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  const int64_t head_dim = kv_cache.size(4);
#if defined(PAGEDSERVE_DPBF16)
  const auto make_rows = [&](auto element) {
    using Element = decltype(element);
    const int8_t* data = kv_cache.data_ptr<int8_t>();
    const float* scales = kv_scales.data_ptr<float>();
    return Int8Rows<Element>{data, data + kv_cache.stride(0), scales, scales + kv_scales.stride(0),
                             kv_cache.stride(1), kv_cache.stride(2), kv_scales.stride(1), kv_scales.stride(2),
                             num_blocks, head_dim};
  };
  return run_unit(unit, query, make_rows, block_size, num_kv_heads, block_table, seq_lens, query_start_loc, scale,
                  sliding_window);
#else
  return at::Tensor();  // unreachable: check_prefill_inputs raised
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("paged_prefill_attention(Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
        "Tensor query_start_loc, float scale, int? sliding_window, str products=\"auto\") -> Tensor");
  m.def("paged_prefill_attention_int8(Tensor query, Tensor kv_cache, Tensor kv_scales, Tensor block_table, "
        "Tensor seq_lens, Tensor query_start_loc, float scale, int? sliding_window, str products=\"auto\") -> Tensor");
  m.def("is_prefill_attention_supported() -> bool", &is_prefill_attention_supported);
  m.def("prefill_attention_products() -> str[]", &prefill_attention_products);
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention);
  m.impl("paged_prefill_attention_int8", &paged_prefill_attention_int8);
}
