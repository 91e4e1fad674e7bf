// Paged decode attention for the CPU, reading the KV cache in place through the block table.
//
// Op: pagedserve::paged_decode_attention(query [num_decodes, num_heads, head_dim],
//       kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim], block_table [num_decodes, *] int32,
//       seq_lens [num_decodes] int32, scale, sliding_window?, partition_size)
//     -> out [num_decodes, num_heads, head_dim] (query's dtype)
//
// Decode i attends its single query (at position seq_lens[i] - 1) to positions
// [max(0, seq_len - sliding_window), seq_len) of its context (causality is implied: nothing later exists).
//
// Work decomposition (the invariants the Python side and the tests rely on):
// - A request's visible context is cut into partitions of `partition_size` tokens aligned on absolute
//   positions (multiples of partition_size). Each (request, kv_head, partition) is one work item: its
//   query heads (the GQA group sharing the KV head) are processed together, so each K/V row is loaded once.
//   An item computes an exact softmax over its partition in fp32: scores, max m, p = exp(s - m), l = sum p,
//   acc = sum p * v. A request with several partitions merges them in partition order (flash-decoding).
// - The partitioning and every summation order depend only on the request's own length, sliding window
//   and partition_size, never on the other requests or on the thread count: a request's output is
//   bitwise identical whatever batch it is in (batch invariance) and however many threads run.
// - Items run in parallel with at::parallel_for (torch's intra-op pool: torch.set_num_threads governs it).
//   Partitions keep items of similar cost, so the static split of the item range balances well, and one
//   long request alone still spreads over every thread.
// - At batch 64 the kernel is bound by memory, more precisely by how many cache lines one core keeps in
//   flight (an item reads 128-byte rows 384 bytes apart from scattered blocks: the hardware prefetchers
//   barely help), so the fast path prefetches every key row a fixed distance ahead and every value row
//   during the key pass, and keeps the arithmetic per row small (one horizontal-sum tree per four keys, bf16
//   widened without shuffles) so that it hides under the misses. With a bf16 query and cache (head_dim 64 or
//   128) both products run on VDPBF16PS instead (attend_partition_bf16: half the instructions per key, P rounded
//   to bf16 for the value product).
// - Levels: the vector paths are written once on float_vector.h's FloatVector, 16 lanes on AVX-512 and 8 on AVX2
//   (FMA; bf16 widened by a shift, exp by the same Cephes polynomial with the same flush to 0 below ln(FLT_MIN)); a
//   build without either runs scalar loops (std::exp). A level's lane count fixes its summation trees, so two
//   levels' results differ in the last bits; within a level every invariant above holds.
//
// Op: pagedserve::reshape_and_cache(key [num_tokens, num_kv_heads, head_dim],
//       value [num_tokens, num_kv_heads, head_dim], kv_cache (mutated), slot_mapping [num_tokens] int64)
//     -> ()
//
// Writes token i's K and V rows into flat slot slot_mapping[i] of the cache's K and V planes (a slot is
// block_id * block_size + offset); a negative slot is skipped (vLLM's padding convention; the Python side
// passes only the step's real tokens today). Equal to torch_paged.write_to_kv_cache bit for bit: same-dtype
// rows are copied, float32 -> bfloat16 rounds to nearest even exactly as Tensor.to() does (NaN -> NaN), and
// bfloat16 -> float32 is exact. key/value may be any views (the fused QKV output: rows and heads are
// addressed through their strides, never copied first); a contiguous head_dim takes the vector path.
//
// int8 cache (kv_cache_dtype="int8", attention/kv_quantization.py): kv_cache is then the int8 view [2, num_blocks,
// block_size, num_kv_heads, head_dim] of byte pages (block stride = the page's bytes, K and V planes one plane's
// bytes apart) and kv_scales the float32 view [2, num_blocks, block_size, num_kv_heads] of the same pages.
// Op: pagedserve::paged_decode_attention_int8(query, kv_cache, kv_scales, block_table, seq_lens, scale,
//       sliding_window?, partition_size) -> out: the same work items, partitions and merges as above; an item reads
//     int8 rows in place and applies the row's scale once per row: score = (q . k_int8) * k_scale, and
//     acc += (p * v_scale) * v_int8 (no dequantized copy of anything). On AVX-512 with head_dim 64 or 128 and a
//     GQA group of 1-8, attend_partition_int8_fixed widens each key row once for all of the group's heads and
//     keeps the dots and the value accumulators in registers (the fp32 fast path's structure); its scores differ
//     from the generic loop's only in the horizontal-sum tree (last bits). Other shapes and levels take the
//     generic loop, attend_partition_int8.
// Op: pagedserve::reshape_and_cache_int8(key, value, kv_cache (mutated), kv_scales (mutated), slot_mapping) -> ():
//     quantizes each token's row of each KV head: scale = max|x| / 127 (float32), q = nearbyint(x / scale) (round
//     half to even, clamped to [-127, 127]; a zero row stores scale 0 and zeros). Bitwise
//     kv_quantization.write_to_int8_kv_cache.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "float_vector.h"
#include "paged_decode_attention.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#include "exp_polynomial.h"
#endif

namespace {

inline float to_float(float value) { return value; }
inline float to_float(c10::BFloat16 value) { return static_cast<float>(value); }

template <typename scalar_t>
inline scalar_t from_float(float value) { return static_cast<scalar_t>(value); }

#if defined(PAGEDSERVE_FLOAT_VECTOR)
// The vector paths are written once on the build's float vector (float_vector.h): 16 lanes on AVX-512, 8 on AVX2.
using Vec = pagedserve_native::FloatVector;
constexpr int kLanes = Vec::kLanes;

// e^x of s - max(s) <= 0: Cephes' polynomial to ~1 ulp (exp_polynomial.h, vector_avx2.h), below ln(FLT_MIN) flushed
// to exactly 0 on both levels (no probability is subnormal).
#if defined(__AVX512F__)
inline __m512 probability_exp(__m512 x) {
  return pagedserve_native::cephes_exp16(x, -87.33654475f, 88.3762626647949f);
}
#else
inline __m256 probability_exp(__m256 x) {
  return pagedserve_native::cephes_exp8(x, -87.33654475f, 88.3762626647949f);
}
#endif
#endif

// One (request, kv_head, partition) item's geometry.
struct WorkItem {
  int32_t request;
  int32_t kv_head;
  int32_t token_begin;  // absolute positions [token_begin, token_end)
  int32_t token_end;
  int32_t num_partitions;  // of this request (1: write the output directly)
  int32_t partition_index;
};

struct Geometry {
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t group;  // query heads per KV head
  int64_t head_dim;
  int64_t block_size;
  int64_t num_blocks;
  int64_t token_stride;  // elements between consecutive tokens of a block (num_kv_heads * head_dim)
  int64_t block_stride;  // elements between blocks (block_size * token_stride)
  int64_t value_offset;  // elements from the K plane to the V plane
  int64_t query_token_stride;
  int64_t query_head_stride;
  int64_t table_stride;
  int64_t partition_size;
  // int8 caches only: the float32 scale view's data and its strides (elements) between tokens, blocks, K and V.
  const float* scales = nullptr;
  int64_t scale_token_stride = 0;
  int64_t scale_block_stride = 0;
  int64_t scale_value_offset = 0;
};

// Issues prefetches for `num_rows` rows of `row_bytes` bytes, `stride_bytes` apart, from `base`.
inline void prefetch_rows(const char* base, int64_t num_rows, int64_t stride_bytes, int64_t row_bytes) {
#if defined(__AVX512F__) || defined(__SSE__)
  for (int64_t row = 0; row < num_rows; ++row)
    for (int64_t line = 0; line < row_bytes; line += 64) _mm_prefetch(base + row * stride_bytes + line, _MM_HINT_T0);
#endif
}

// Calls visit(t, offset) for each position t in [begin, end) (t relative to begin) with the element offset of
// the position's row for `kv_head` in the K plane, walking block by block (no division per token).
// With `prefetch_cache` (the key pass), each block also prefetches the next block's key rows (blocks are
// scattered, so the hardware prefetcher cannot guess them) and its own value rows for the value pass.
template <typename cache_t, typename Visit>
inline void for_each_row(const Geometry& g, const int32_t* table_row, int64_t kv_head, int64_t begin, int64_t end,
                         const cache_t* prefetch_cache, Visit&& visit) {
  const int64_t head_offset = kv_head * g.head_dim;
  const int64_t row_bytes = g.head_dim * static_cast<int64_t>(sizeof(cache_t));
  const int64_t stride_bytes = g.token_stride * static_cast<int64_t>(sizeof(cache_t));
  int64_t position = begin;
  while (position < end) {
    const int64_t block_index = position / g.block_size;
    const int64_t block_id = table_row[block_index];
    TORCH_CHECK(block_id >= 0 && block_id < g.num_blocks, "paged_decode_attention: block id ", block_id,
                " out of range [0, ", g.num_blocks, ")");
    const int64_t block_end = std::min(end, (block_index + 1) * g.block_size);
    int64_t offset = block_id * g.block_stride + (position % g.block_size) * g.token_stride + head_offset;
    if (prefetch_cache != nullptr) {
      if (block_end < end) {
        const int64_t next_id = table_row[block_index + 1];
        if (next_id >= 0 && next_id < g.num_blocks)
          prefetch_rows(reinterpret_cast<const char*>(prefetch_cache + next_id * g.block_stride + head_offset),
                        std::min(g.block_size, end - block_end), stride_bytes, row_bytes);
      }
      prefetch_rows(reinterpret_cast<const char*>(prefetch_cache + g.value_offset + offset), block_end - position,
                    stride_bytes, row_bytes);
    }
    for (; position < block_end; ++position, offset += g.token_stride) visit(position - begin, offset);
  }
}

// The next work item's key rows, prefetched toward L2 while the current item's value pass runs. The value pass
// reads rows that the key pass already prefetched, so without this a core leaves memory idle for the value pass and
// the softmax (the kernel ran at 15-16 GB/s from DRAM where a plain 2-thread read runs 31 GB/s; with it, 22-23 GB/s).
// Lines are issued evenly over the value pass's steps so they never crowd one stretch of it.
struct NextItemKeys {
  const char* plane = nullptr;           // the K plane, as bytes
  const int64_t* row_offsets = nullptr;  // element offsets of the next item's rows in the plane
  int64_t element_bytes = 0;
  int64_t row_lines = 0;  // 64-byte lines per row
  int64_t num_lines = 0;  // 0: nothing to prefetch
  int64_t num_issued = 0;

  // Issues the lines due once step `step` of `num_steps` is done.
  inline void advance(int64_t step, int64_t num_steps) {
    const int64_t due = (step + 1) * num_lines / num_steps;
    for (; num_issued < due; ++num_issued) {
#if defined(__AVX512F__) || defined(__SSE__)
      const int64_t row = num_issued / row_lines;
      _mm_prefetch(plane + row_offsets[row] * element_bytes + (num_issued - row * row_lines) * 64, _MM_HINT_T1);
#endif
    }
  }
};

// The plan for prefetching `next`'s key rows: resolves their offsets into `row_offsets` (partition_size entries).
template <typename cache_t>
NextItemKeys plan_next_item_keys(const WorkItem& next, const Geometry& g, const int32_t* block_table,
                                 const cache_t* cache, int64_t* row_offsets) {
  for_each_row(g, block_table + next.request * g.table_stride, next.kv_head, next.token_begin, next.token_end,
               static_cast<const cache_t*>(nullptr), [&](int64_t t, int64_t offset) { row_offsets[t] = offset; });
  NextItemKeys plan;
  plan.plane = reinterpret_cast<const char*>(cache);
  plan.row_offsets = row_offsets;
  plan.element_bytes = static_cast<int64_t>(sizeof(cache_t));
  plan.row_lines = (g.head_dim * plan.element_bytes + 63) / 64;
  plan.num_lines = (next.token_end - next.token_begin) * plan.row_lines;
  return plan;
}

// Scalar-query staging shared by both paths: query_scaled[j][d] = q[kv_head * group + j][d] * scale.
template <typename query_t>
inline void stage_query(const WorkItem& item, const Geometry& g, const query_t* query, float scale,
                        float* query_scaled) {
  const query_t* query_row = query + item.request * g.query_token_stride;
  for (int64_t j = 0; j < g.group; ++j) {
    const query_t* head = query_row + (item.kv_head * g.group + j) * g.query_head_stride;
    for (int64_t d = 0; d < g.head_dim; ++d) query_scaled[j * g.head_dim + d] = to_float(head[d]) * scale;
  }
}

// 2. Softmax numerators over the partition, in place: p = exp(s - max); returns max and sum(p) per head.
inline void partition_softmax(const Geometry& g, int64_t num_tokens, float* scores, float* max_out,
                              float* sum_out) {
  for (int64_t j = 0; j < g.group; ++j) {
    float* row = scores + j * g.partition_size;
    float maximum = -std::numeric_limits<float>::infinity();
    float total = 0.f;
#if defined(PAGEDSERVE_FLOAT_VECTOR)
    Vec::Type maxima = Vec::set1(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + kLanes <= num_tokens; t += kLanes) maxima = Vec::max(maxima, Vec::load(row + t));
    maximum = Vec::reduce_max(maxima);
    for (; t < num_tokens; ++t) maximum = std::max(maximum, row[t]);
    const Vec::Type shift = Vec::set1(maximum);
    Vec::Type totals = Vec::zero();
    for (t = 0; t < num_tokens; t += kLanes) {
      const int64_t count = num_tokens - t;  // lanes past it are neither read, written nor summed
      const Vec::Type p = probability_exp(Vec::sub(Vec::load_first(row + t, count), shift));
      Vec::store_first(row + t, p, count);
      totals = Vec::add(totals, Vec::keep_first(p, count));
    }
    total = Vec::reduce_add(totals);
#else
    for (int64_t t = 0; t < num_tokens; ++t) maximum = std::max(maximum, row[t]);
    for (int64_t t = 0; t < num_tokens; ++t) {
      row[t] = std::exp(row[t] - maximum);
      total += row[t];
    }
#endif
    max_out[j] = maximum;
    sum_out[j] = total;
  }
}

// Computes one item's unnormalised partial result: acc [group, head_dim], max [group], sum [group].
// `scores` holds group * partition_size floats of scratch, `query_scaled` group * head_dim.
// The generic path: any group size and head_dim (vectors when head_dim is a multiple of the lane count: 16 on
// AVX-512, 8 on AVX2; else scalar).
template <typename query_t, typename cache_t>
void attend_partition_generic(const WorkItem& item, const Geometry& g, const query_t* query, const cache_t* cache,
                              const int32_t* block_table, float scale, float* query_scaled, float* scores,
                              int64_t* /*row_offsets*/, float* acc, float* max_out, float* sum_out,
                              NextItemKeys& next_keys) {
  const int64_t group = g.group;
  const int64_t head_dim = g.head_dim;
  const int64_t num_tokens = item.token_end - item.token_begin;
  const int64_t score_stride = g.partition_size;
  stage_query(item, g, query, scale, query_scaled);
  const int32_t* table_row = block_table + item.request * g.table_stride;
#if defined(PAGEDSERVE_FLOAT_VECTOR)
  const bool vectorized = head_dim % kLanes == 0;
#else
  const bool vectorized = false;
#endif
  // 1. scores[j][t] = (q_j * scale) . k_t
  for_each_row(g, table_row, item.kv_head, item.token_begin, item.token_end, cache, [&](int64_t t, int64_t offset) {
    const cache_t* key = cache + offset;
    if (vectorized) {
#if defined(PAGEDSERVE_FLOAT_VECTOR)
      for (int64_t j = 0; j < group; ++j) {
        Vec::Type sum = Vec::zero();
        for (int64_t d = 0; d < head_dim; d += kLanes)
          sum = Vec::fmadd(Vec::load(query_scaled + j * head_dim + d), Vec::load(key + d), sum);
        scores[j * score_stride + t] = Vec::reduce_add(sum);
      }
#endif
    } else {
      for (int64_t j = 0; j < group; ++j) {
        float sum = 0.f;
        const float* q = query_scaled + j * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) sum += q[d] * to_float(key[d]);
        scores[j * score_stride + t] = sum;
      }
    }
  });
  partition_softmax(g, num_tokens, scores, max_out, sum_out);
  // 3. acc[j] = sum_t p[j][t] * v_t
  std::fill(acc, acc + group * head_dim, 0.f);
  for_each_row(g, table_row, item.kv_head, item.token_begin, item.token_end, static_cast<const cache_t*>(nullptr),
               [&](int64_t t, int64_t offset) {
    next_keys.advance(t, num_tokens);
    const cache_t* value = cache + g.value_offset + offset;
    for (int64_t j = 0; j < group; ++j) {
      const float p = scores[j * score_stride + t];
      float* out = acc + j * head_dim;
      if (vectorized) {
#if defined(PAGEDSERVE_FLOAT_VECTOR)
        for (int64_t d = 0; d < head_dim; d += kLanes)
          Vec::store(out + d, Vec::fmadd(Vec::set1(p), Vec::load(value + d), Vec::load(out + d)));
#endif
      } else {
        for (int64_t d = 0; d < head_dim; ++d) out[d] += p * to_float(value[d]);
      }
    }
  });
}

#if defined(PAGEDSERVE_FLOAT_VECTOR)
// Lane layout of the fast path (L = kLanes: 16 on AVX-512, 8 on AVX2). A float32 row is read as is: vector c holds
// dimensions [Lc, Lc + L). A bfloat16 row is read 2L dimensions (one full-width load) at a time and widened without
// a shuffle: the even dimensions are the low halves of the 32-bit lanes (shift left by 16), the odd ones the high
// halves (mask), so vector 2p holds dimensions 2Lp + 2i and vector 2p + 1 dimensions 2Lp + 2i + 1 (i = lane). The
// staged query and the value accumulators use the same layout; the accumulators are put back in order per item.
template <typename cache_t>
struct RowLayout;

template <>
struct RowLayout<float> {
  static constexpr int kChunksPerLoad = 1;
  static constexpr int64_t lane_of(int64_t dimension) { return dimension; }
  // Vectors [c, c + kChunksPerLoad) of `row` into out[0, kChunksPerLoad) (c a multiple of kChunksPerLoad).
  static inline void load(const float* row, int c, Vec::Type* out) { out[0] = Vec::load(row + c * kLanes); }
};

template <>
struct RowLayout<c10::BFloat16> {
  static constexpr int kChunksPerLoad = 2;
  static constexpr int64_t lane_of(int64_t dimension) {
    return dimension / (2 * kLanes) * (2 * kLanes) + dimension % 2 * kLanes + dimension % (2 * kLanes) / 2;
  }
  static inline void load(const c10::BFloat16* row, int c, Vec::Type* out) {
    Vec::load_split(row + c * kLanes, out[0], out[1]);
  }
};

// Lane t (< 4) of the result: the sum of the lanes of the t-th argument, in a fixed tree order (in each 128-bit
// quarter lanes 2 apart, then the two pair sums; then the quarters, pairwise). One tree serves four keys: about a
// third of the instructions of four separate reductions.
#if defined(__AVX512F__)
inline __m128 sum_lanes_of_4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512d ab = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)));
  const __m512d cd = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d)));
  // Each 128-bit quarter now holds [a, b, c, d] summed over that quarter.
  const __m512 quarters = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab, cd)),
                                        _mm512_castpd_ps(_mm512_unpackhi_pd(ab, cd)));
  const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(quarters),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(quarters), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
}
#else
inline __m128 sum_lanes_of_4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256d ab = _mm256_castps_pd(_mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b)));
  const __m256d cd = _mm256_castps_pd(_mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d)));
  // Each 128-bit half now holds [a, b, c, d] summed over that half.
  const __m256 halves = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(ab, cd)),
                                      _mm256_castpd_ps(_mm256_unpackhi_pd(ab, cd)));
  return _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
}
#endif

// Stores the scores of four consecutive keys, or of the first `count` (< 4) at a partition's end.
inline void store_scores(__m128 sums, float* destination, int64_t count) {
  if (count == 4) {
    _mm_storeu_ps(destination, sums);
    return;
  }
  alignas(16) float partial[4];
  _mm_store_ps(partial, sums);
  std::copy(partial, partial + count, destination);
}

// Key rows are prefetched this many positions ahead of the key pass (blocks are scattered, so the hardware
// prefetcher cannot follow them across a block boundary); each position's value row is prefetched as its
// key is read, for the value pass that follows.
constexpr int64_t kPrefetchPositions = 32;

inline void prefetch_row(const void* row, int64_t row_bytes) {
  for (int64_t line = 0; line < row_bytes; line += 64)
    _mm_prefetch(static_cast<const char*>(row) + line, _MM_HINT_T0);
}

inline void prefetch_row_to_l2(const void* row, int64_t row_bytes) {
  for (int64_t line = 0; line < row_bytes; line += 64)
    _mm_prefetch(static_cast<const char*>(row) + line, _MM_HINT_T1);
}

// The bfloat16 path prefetches value rows to L2 only during the key pass (a 256-token partition's keys and values
// outgrow L1's 48 KiB, and L1 prefetches stall once its fill buffers are taken: 45% of that kernel's samples sat
// on prefetch instructions at GQA group 3), then to L1 this many positions ahead of the value pass.
constexpr int64_t kValuePrefetchPositions = 16;

// Register blocks of the fast path, sized by the level's vector registers (32 on AVX-512, 16 on AVX2):
// - the key pass holds kKeys scores of up to kMaxHeadsPerSweep heads, plus one load of a key row and a query vector
//   (4 x 4 + 3 of 32; 3 x 4 + 3 of 16);
// - the value pass holds three quarters of the registers in accumulators (24; 12), the rest for one load of a
//   value row and the broadcast probability.
constexpr int kMaxHeadsPerSweep = Vec::kRegisters >= 32 ? 4 : 3;
constexpr int kValueAccumulators = Vec::kRegisters * 3 / 4;

// The fast path for a compile-time group size kGroup and head_dim = kLanes * kChunks: the partition's row
// offsets are resolved first, scores are computed four keys at a time (each key row loaded once for up to
// kMaxHeadsPerSweep heads, one horizontal-sum tree per four keys), and the value accumulators stay in registers.
template <typename query_t, typename cache_t, int kGroup, int kChunks>
void attend_partition_fixed(const WorkItem& item, const Geometry& g, const query_t* query, const cache_t* cache,
                            const int32_t* block_table, float scale, float* query_scaled, float* scores,
                            int64_t* row_offsets, float* acc, float* max_out, float* sum_out,
                            NextItemKeys& next_keys) {
  using Layout = RowLayout<cache_t>;
  constexpr int kLoad = Layout::kChunksPerLoad;
  static_assert(kChunks % kLoad == 0, "bfloat16 rows are read 2 * kLanes dimensions at a time");
  constexpr int kHeadDim = kChunks * kLanes;
  constexpr int kKeys = 4;  // keys per horizontal-sum tree
  constexpr int kHeadsPerSweep = kGroup < kMaxHeadsPerSweep ? kGroup : kMaxHeadsPerSweep;
  const int64_t num_tokens = item.token_end - item.token_begin;
  const int64_t score_stride = g.partition_size;
  const int64_t row_bytes = kHeadDim * static_cast<int64_t>(sizeof(cache_t));
  const cache_t* values = cache + g.value_offset;
  const query_t* query_row = query + item.request * g.query_token_stride;
  for (int j = 0; j < kGroup; ++j) {
    const query_t* head = query_row + (item.kv_head * kGroup + j) * g.query_head_stride;
    for (int64_t d = 0; d < kHeadDim; ++d) query_scaled[j * kHeadDim + Layout::lane_of(d)] = to_float(head[d]) * scale;
  }
  const int32_t* table_row = block_table + item.request * g.table_stride;
  for_each_row(g, table_row, item.kv_head, item.token_begin, item.token_end, static_cast<const cache_t*>(nullptr),
               [&](int64_t t, int64_t offset) { row_offsets[t] = offset; });
  for (int64_t t = 0; t < std::min(num_tokens, kPrefetchPositions); ++t)
    prefetch_row(cache + row_offsets[t], row_bytes);

  // 1. scores[j][t] = (q_j * scale) . k_t
  for (int64_t t0 = 0; t0 < num_tokens; t0 += kKeys) {
    const int64_t count = std::min<int64_t>(kKeys, num_tokens - t0);
    for (int64_t t = t0; t < t0 + count; ++t) {
      if (t + kPrefetchPositions < num_tokens) prefetch_row(cache + row_offsets[t + kPrefetchPositions], row_bytes);
      prefetch_row(values + row_offsets[t], row_bytes);
    }
    for (int j0 = 0; j0 < kGroup; j0 += kHeadsPerSweep) {
      // Fully unrolled (pragmas: GCC's size limits left the key loop rolled, and `dots` in memory, for fp32 rows):
      // every dot stays in a register.
      Vec::Type dots[kHeadsPerSweep][kKeys];
#pragma GCC unroll 4
      for (int t = 0; t < kKeys; ++t) {
        // Past the partition's end the last row is read again; those scores are not stored.
        const cache_t* key_row = cache + row_offsets[t0 + std::min<int64_t>(t, count - 1)];
#pragma GCC unroll 16
        for (int c0 = 0; c0 < kChunks; c0 += kLoad) {
          Vec::Type key[kLoad];
          Layout::load(key_row, c0, key);
#pragma GCC unroll 4
          for (int j = 0; j < kHeadsPerSweep; ++j) {
            if (j0 + j >= kGroup) break;
            const float* q = query_scaled + (j0 + j) * kHeadDim;
#pragma GCC unroll 2
            for (int c = 0; c < kLoad; ++c) {
              const Vec::Type q_chunk = Vec::load(q + (c0 + c) * kLanes);
              dots[j][t] = c0 + c == 0 ? Vec::mul(q_chunk, key[c]) : Vec::fmadd(q_chunk, key[c], dots[j][t]);
            }
          }
        }
      }
      for (int j = 0; j < kHeadsPerSweep; ++j) {
        if (j0 + j >= kGroup) break;
        store_scores(sum_lanes_of_4(dots[j][0], dots[j][1], dots[j][2], dots[j][3]),
                     scores + (j0 + j) * score_stride + t0, count);
      }
    }
  }
  partition_softmax(g, num_tokens, scores, max_out, sum_out);

  // 2. acc[j] = sum_t p[j][t] * v_t, kChunksPerPass vectors of every head in registers over the partition.
  constexpr int kFit = kValueAccumulators / kGroup > 0 ? kValueAccumulators / kGroup : 1;
  constexpr int kFitLoads = kFit / kLoad * kLoad;
  constexpr int kChunksPerPass = kChunks <= kFit ? kChunks : (kFitLoads > 0 ? kFitLoads : kLoad);
  alignas(64) float laned[kGroup * kHeadDim];
  for (int c0 = 0; c0 < kChunks; c0 += kChunksPerPass) {
    Vec::Type sums[kGroup][kChunksPerPass];
    for (int j = 0; j < kGroup; ++j)
      for (int c = 0; c < kChunksPerPass; ++c) sums[j][c] = Vec::zero();
    for (int64_t t = 0; t < num_tokens; ++t) {
      if (c0 == 0) next_keys.advance(t, num_tokens);
      const cache_t* value_row = values + row_offsets[t];
#pragma GCC unroll 16
      for (int c1 = 0; c1 < kChunksPerPass; c1 += kLoad) {
        if (c0 + c1 >= kChunks) break;
        Vec::Type v[kLoad];
        Layout::load(value_row, c0 + c1, v);
#pragma GCC unroll 8
        for (int j = 0; j < kGroup; ++j) {
          const Vec::Type p = Vec::set1(scores[j * score_stride + t]);
#pragma GCC unroll 2
          for (int c = 0; c < kLoad; ++c) sums[j][c1 + c] = Vec::fmadd(p, v[c], sums[j][c1 + c]);
        }
      }
    }
    for (int j = 0; j < kGroup; ++j)
      for (int c = 0; c < kChunksPerPass; ++c)
        if (c0 + c < kChunks) Vec::store(laned + j * kHeadDim + (c0 + c) * kLanes, sums[j][c]);
  }
  for (int j = 0; j < kGroup; ++j)
    for (int64_t d = 0; d < kHeadDim; ++d) acc[j * kHeadDim + d] = laned[j * kHeadDim + Layout::lane_of(d)];
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// The bfloat16 fast path (bf16 query and cache): both products on VDPBF16PS, which multiplies pairs of bf16 in
// fp32 and adds both products into an fp32 lane, so a key row is used as stored (no widening) and each
// instruction does two multiply-adds. With GQA groups the widened-fp32 path above ran out of instructions before
// memory (13.5 GB/s at group 3 against 23 GB/s at group 1); this one needs about half as many per key.
// - Scores: lane i of a query-key product sums dims 2i and 2i + 1 (a row is 32 dims per 512-bit vector, in
//   order); the unscaled score is reduced four keys at a time (sum_lanes_of_4), then multiplied by the scale.
// - Values: two keys t, t + 1 at a time. Interleaving their rows 16 bits at a time (unpacklo/hi within each
//   128-bit lane) gives pair vectors whose fp32 lane 4L + i holds dim 8L + i (lo) or 8L + 4 + i (hi) of a
//   32-dim slice; the probabilities (p_t, p_t+1) are rounded to bf16 and broadcast as one pair. An odd last key
//   is paired with itself at probability 0.
// - Prefetching: key rows to L1 as the fp32 path; value rows to L2 during the key pass and to L1
//   kValuePrefetchPositions ahead of the value pass (13 -> 17 GB/s at 64 requests, group 3).
// - Numerics: fp32 sums in a fixed order per request (batch and thread-count invariant); P is rounded to bf16
//   for the value product (as the AMX prefill kernel and ATen's bf16 flash attention do) while the softmax
//   denominator sums the fp32 probabilities.
template <int kGroup, int kChunks>
void attend_partition_bf16(const WorkItem& item, const Geometry& g, const c10::BFloat16* query,
                           const c10::BFloat16* cache, const int32_t* block_table, float scale, float* query_scratch,
                           float* scores, int64_t* row_offsets, float* acc, float* max_out, float* sum_out,
                           NextItemKeys& next_keys) {
  constexpr int kHeadDim = kChunks * kLanes;
  constexpr int kLoads = kHeadDim / 32;  // 512-bit vectors per row
  constexpr int kKeys = 4;
  constexpr int kHeadsPerSweep = kGroup < 4 ? kGroup : 4;
  // Value accumulators held per pass: at most 16 registers (2 pair vectors per 32-dim slice).
  constexpr int kLoadsPerPass = 8 / kGroup > 0 ? (8 / kGroup < kLoads ? 8 / kGroup : kLoads) : 1;
  const int64_t num_tokens = item.token_end - item.token_begin;
  const int64_t score_stride = g.partition_size;
  const int64_t row_bytes = kHeadDim * 2;
  const c10::BFloat16* values = cache + g.value_offset;
  // The group's query rows, unscaled, in the query scratch (bf16, kGroup * kHeadDim values).
  c10::BFloat16* query_rows = reinterpret_cast<c10::BFloat16*>(query_scratch);
  const c10::BFloat16* query_row = query + item.request * g.query_token_stride;
  for (int j = 0; j < kGroup; ++j)
    std::memcpy(query_rows + j * kHeadDim, query_row + (item.kv_head * kGroup + j) * g.query_head_stride, row_bytes);
  const int32_t* table_row = block_table + item.request * g.table_stride;
  for_each_row(g, table_row, item.kv_head, item.token_begin, item.token_end, static_cast<const c10::BFloat16*>(nullptr),
               [&](int64_t t, int64_t offset) { row_offsets[t] = offset; });
  for (int64_t t = 0; t < std::min(num_tokens, kPrefetchPositions); ++t) prefetch_row(cache + row_offsets[t], row_bytes);

  // 1. scores[j][t] = (q_j . k_t) * scale
  const __m128 scale_vector = _mm_set1_ps(scale);
  for (int64_t t0 = 0; t0 < num_tokens; t0 += kKeys) {
    const int64_t count = std::min<int64_t>(kKeys, num_tokens - t0);
    for (int64_t t = t0; t < t0 + count; ++t) {
      if (t + kPrefetchPositions < num_tokens) prefetch_row(cache + row_offsets[t + kPrefetchPositions], row_bytes);
      prefetch_row_to_l2(values + row_offsets[t], row_bytes);
    }
    for (int j0 = 0; j0 < kGroup; j0 += kHeadsPerSweep) {
      __m512 dots[kHeadsPerSweep][kKeys];
      for (int t = 0; t < kKeys; ++t) {
        // Past the partition's end the last row is read again; those scores are not stored.
        const c10::BFloat16* key_row = cache + row_offsets[t0 + std::min<int64_t>(t, count - 1)];
        __m512bh key[kLoads];
        for (int l = 0; l < kLoads; ++l) key[l] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(key_row + l * 32));
        for (int j = 0; j < kHeadsPerSweep; ++j) {
          if (j0 + j >= kGroup) break;
          const c10::BFloat16* q = query_rows + (j0 + j) * kHeadDim;
          __m512 dot = _mm512_setzero_ps();
          for (int l = 0; l < kLoads; ++l)
            dot = _mm512_dpbf16_ps(dot, reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + l * 32)), key[l]);
          dots[j][t] = dot;
        }
      }
      for (int j = 0; j < kHeadsPerSweep; ++j) {
        if (j0 + j >= kGroup) break;
        store_scores(_mm_mul_ps(sum_lanes_of_4(dots[j][0], dots[j][1], dots[j][2], dots[j][3]), scale_vector),
                     scores + (j0 + j) * score_stride + t0, count);
      }
    }
  }
  partition_softmax(g, num_tokens, scores, max_out, sum_out);

  // The probabilities in bf16, in place over each head's scores (a bf16 value at t is written below the float at t
  // that was already read), with a zero after an odd last key.
  const int64_t num_pairs = (num_tokens + 1) / 2;
  for (int j = 0; j < kGroup; ++j) {
    float* row = scores + j * score_stride;
    uint16_t* bits = reinterpret_cast<uint16_t*>(row);
    for (int64_t t = 0; t < num_tokens; t += kLanes) {
      const int64_t n = std::min<int64_t>(kLanes, num_tokens - t);
      const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1u);
      const __m256i rounded = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, row + t)));
      _mm256_mask_storeu_epi16(bits + t, mask, rounded);
    }
    if (num_tokens % 2 != 0) bits[num_tokens] = 0;
  }

  // 2. acc[j] = sum_t p[j][t] * v_t, two keys per instruction.
  alignas(64) float laned[kGroup * kHeadDim];
  for (int l0 = 0; l0 < kLoads; l0 += kLoadsPerPass) {
    __m512 sums[kGroup][2 * kLoadsPerPass];
    for (int j = 0; j < kGroup; ++j)
      for (int c = 0; c < 2 * kLoadsPerPass; ++c) sums[j][c] = _mm512_setzero_ps();
    for (int64_t pair = 0; pair < num_pairs; ++pair) {
      const int64_t t = 2 * pair;
      if (l0 == 0) {
        for (int64_t ahead = t + kValuePrefetchPositions; ahead < std::min(t + kValuePrefetchPositions + 2, num_tokens);
             ++ahead)
          prefetch_row(values + row_offsets[ahead], row_bytes);
        next_keys.advance(pair, num_pairs);
      }
      const c10::BFloat16* first = values + row_offsets[t];
      const c10::BFloat16* second = t + 1 < num_tokens ? values + row_offsets[t + 1] : first;
      __m512bh v[2 * kLoadsPerPass];
      for (int l = 0; l < kLoadsPerPass; ++l) {
        if (l0 + l >= kLoads) break;
        const __m512i a = _mm512_loadu_si512(first + (l0 + l) * 32);
        const __m512i b = _mm512_loadu_si512(second + (l0 + l) * 32);
        v[2 * l] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(a, b));
        v[2 * l + 1] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(a, b));
      }
      for (int j = 0; j < kGroup; ++j) {
        uint32_t probability_pair;
        std::memcpy(&probability_pair, reinterpret_cast<const uint16_t*>(scores + j * score_stride) + t, 4);
        const __m512bh p = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(probability_pair)));
        for (int c = 0; c < 2 * kLoadsPerPass; ++c)
          if (l0 + c / 2 < kLoads) sums[j][c] = _mm512_dpbf16_ps(sums[j][c], v[c], p);
      }
    }
    for (int j = 0; j < kGroup; ++j)
      for (int c = 0; c < 2 * kLoadsPerPass; ++c)
        if (l0 + c / 2 < kLoads) _mm512_store_ps(laned + j * kHeadDim + (2 * l0 + c) * kLanes, sums[j][c]);
  }
  // Pair vector c of slice l = c / 2: lane 4L + i holds dim 32 l + 8 L + 4 (c % 2) + i.
  for (int j = 0; j < kGroup; ++j)
    for (int c = 0; c < 2 * kLoads; ++c)
      for (int lane = 0; lane < kLanes; ++lane)
        acc[j * kHeadDim + 32 * (c / 2) + 8 * (lane / 4) + 4 * (c % 2) + lane % 4] =
            laned[j * kHeadDim + c * kLanes + lane];
}
#endif

// ---- int8 cache ----

#if defined(PAGEDSERVE_FLOAT_VECTOR)
// kLanes int8 values widened to float32 (exact).
#if defined(__AVX512F__)
inline __m512 load_int8_lanes(const int8_t* pointer) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pointer))));
}
#else
inline __m256 load_int8_lanes(const int8_t* pointer) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(pointer))));
}
#endif
#endif

// for_each_row for an int8 cache: visit(t, offset, scale_index) with the row's element offset in the K plane and
// its scale's index in the K scales (add value_offset / scale_value_offset for V).
template <typename Visit>
inline void for_each_int8_row(const Geometry& g, const int32_t* table_row, int64_t kv_head, int64_t begin,
                              int64_t end, Visit&& visit) {
  int64_t position = begin;
  while (position < end) {
    const int64_t block_index = position / g.block_size;
    const int64_t block_id = table_row[block_index];
    TORCH_CHECK(block_id >= 0 && block_id < g.num_blocks, "paged_decode_attention_int8: block id ", block_id,
                " out of range [0, ", g.num_blocks, ")");
    const int64_t block_end = std::min(end, (block_index + 1) * g.block_size);
    const int64_t in_block = position % g.block_size;
    int64_t offset = block_id * g.block_stride + in_block * g.token_stride + kv_head * g.head_dim;
    int64_t scale_index = block_id * g.scale_block_stride + in_block * g.scale_token_stride + kv_head;
    for (; position < block_end; ++position, offset += g.token_stride, scale_index += g.scale_token_stride)
      visit(position - begin, offset, scale_index);
  }
}

// attend_partition_generic over int8 rows: the key scale multiplies each finished dot product, the value scale each
// probability, so rows are widened but never dequantized into memory.
template <typename query_t>
void attend_partition_int8(const WorkItem& item, const Geometry& g, const query_t* query, const int8_t* cache,
                           const int32_t* block_table, float scale, float* query_scaled, float* scores,
                           int64_t* /*row_offsets*/, float* acc, float* max_out, float* sum_out,
                           NextItemKeys& next_keys) {
  const int64_t group = g.group;
  const int64_t head_dim = g.head_dim;
  const int64_t num_tokens = item.token_end - item.token_begin;
  const int64_t score_stride = g.partition_size;
  const float* scales = g.scales;
  stage_query(item, g, query, scale, query_scaled);
  const int32_t* table_row = block_table + item.request * g.table_stride;
#if defined(PAGEDSERVE_FLOAT_VECTOR)
  const bool vectorized = head_dim % kLanes == 0;
#else
  const bool vectorized = false;
#endif
  // 1. scores[j][t] = ((q_j * scale) . k_int8_t) * k_scale_t
  for_each_int8_row(g, table_row, item.kv_head, item.token_begin, item.token_end,
                    [&](int64_t t, int64_t offset, int64_t scale_index) {
    const int8_t* key = cache + offset;
    const float key_scale = scales[scale_index];
    if (vectorized) {
#if defined(PAGEDSERVE_FLOAT_VECTOR)
      for (int64_t j = 0; j < group; ++j) {
        Vec::Type sum = Vec::zero();
        for (int64_t d = 0; d < head_dim; d += kLanes)
          sum = Vec::fmadd(Vec::load(query_scaled + j * head_dim + d), load_int8_lanes(key + d), sum);
        scores[j * score_stride + t] = Vec::reduce_add(sum) * key_scale;
      }
#endif
    } else {
      for (int64_t j = 0; j < group; ++j) {
        float sum = 0.f;
        const float* q = query_scaled + j * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) sum += q[d] * static_cast<float>(key[d]);
        scores[j * score_stride + t] = sum * key_scale;
      }
    }
  });
  partition_softmax(g, num_tokens, scores, max_out, sum_out);
  // 3. acc[j] = sum_t (p[j][t] * v_scale_t) * v_int8_t
  std::fill(acc, acc + group * head_dim, 0.f);
  for_each_int8_row(g, table_row, item.kv_head, item.token_begin, item.token_end,
                    [&](int64_t t, int64_t offset, int64_t scale_index) {
    next_keys.advance(t, num_tokens);
    const int8_t* value = cache + g.value_offset + offset;
    const float value_scale = scales[g.scale_value_offset + scale_index];
    for (int64_t j = 0; j < group; ++j) {
      const float weight = scores[j * score_stride + t] * value_scale;
      float* out = acc + j * head_dim;
      if (vectorized) {
#if defined(PAGEDSERVE_FLOAT_VECTOR)
        for (int64_t d = 0; d < head_dim; d += kLanes)
          Vec::store(out + d, Vec::fmadd(Vec::set1(weight), load_int8_lanes(value + d), Vec::load(out + d)));
#endif
      } else {
        for (int64_t d = 0; d < head_dim; ++d) out[d] += weight * static_cast<float>(value[d]);
      }
    }
  });
}

#if defined(PAGEDSERVE_FLOAT_VECTOR) && defined(__AVX512F__)
// The int8 fast path (AVX-512, head_dim = 16 * kChunks, compile-time GQA group kGroup): attend_partition_fixed's
// structure over int8 rows. Each key row's int8 values are widened to fp32 (vpmovsxbd + vcvtdq2ps, exact) one
// 16-lane chunk at a time and used by up to kMaxHeadsPerSweep heads' accumulators, four keys per horizontal-sum
// tree; the row's key scale then multiplies each finished dot product (score = ((q * scale) . k_int8) * k_scale).
// After the softmax each probability is multiplied by its row's value scale in place (the sums were already taken
// from the unscaled probabilities), and the value pass accumulates (p * v_scale) * v_int8 in registers, over t in
// order, exactly as attend_partition_int8 does (so only the score's summation tree differs from it).
// `row_offsets` holds 2 * partition_size entries: the rows' element offsets, then their scales' indices.
template <typename query_t, int kGroup, int kChunks>
void attend_partition_int8_fixed(const WorkItem& item, const Geometry& g, const query_t* query, const int8_t* cache,
                                 const int32_t* block_table, float scale, float* query_scaled, float* scores,
                                 int64_t* row_offsets, float* acc, float* max_out, float* sum_out,
                                 NextItemKeys& next_keys) {
  constexpr int kHeadDim = kChunks * kLanes;
  constexpr int kKeys = 4;  // keys per horizontal-sum tree
  constexpr int kHeadsPerSweep = kGroup < kMaxHeadsPerSweep ? kGroup : kMaxHeadsPerSweep;
  const int64_t num_tokens = item.token_end - item.token_begin;
  const int64_t score_stride = g.partition_size;
  constexpr int64_t row_bytes = kHeadDim;
  const int8_t* values = cache + g.value_offset;
  const float* key_scales = g.scales;
  const float* value_scales = g.scales + g.scale_value_offset;
  int64_t* scale_indices = row_offsets + g.partition_size;
  stage_query(item, g, query, scale, query_scaled);
  const int32_t* table_row = block_table + item.request * g.table_stride;
  for_each_int8_row(g, table_row, item.kv_head, item.token_begin, item.token_end,
                    [&](int64_t t, int64_t offset, int64_t scale_index) {
    row_offsets[t] = offset;
    scale_indices[t] = scale_index;
  });
  for (int64_t t = 0; t < std::min(num_tokens, kPrefetchPositions); ++t) {
    prefetch_row(cache + row_offsets[t], row_bytes);
    _mm_prefetch(reinterpret_cast<const char*>(key_scales + scale_indices[t]), _MM_HINT_T0);
  }

  // 1. scores[j][t] = ((q_j * scale) . k_int8_t) * k_scale_t
  for (int64_t t0 = 0; t0 < num_tokens; t0 += kKeys) {
    const int64_t count = std::min<int64_t>(kKeys, num_tokens - t0);
    for (int64_t t = t0; t < t0 + count; ++t) {
      if (t + kPrefetchPositions < num_tokens) {
        prefetch_row(cache + row_offsets[t + kPrefetchPositions], row_bytes);
        _mm_prefetch(reinterpret_cast<const char*>(key_scales + scale_indices[t + kPrefetchPositions]), _MM_HINT_T0);
      }
      prefetch_row(values + row_offsets[t], row_bytes);
      _mm_prefetch(reinterpret_cast<const char*>(value_scales + scale_indices[t]), _MM_HINT_T0);
    }
    // Past the partition's end the last row is read again; those scores are not stored.
    const int64_t last = t0 + count - 1;
    const __m128 row_scales = _mm_setr_ps(key_scales[scale_indices[t0]],
                                          key_scales[scale_indices[std::min(t0 + 1, last)]],
                                          key_scales[scale_indices[std::min(t0 + 2, last)]],
                                          key_scales[scale_indices[std::min(t0 + 3, last)]]);
    for (int j0 = 0; j0 < kGroup; j0 += kHeadsPerSweep) {
      __m512 dots[kHeadsPerSweep][kKeys];
#pragma GCC unroll 4
      for (int t = 0; t < kKeys; ++t) {
        const int8_t* key_row = cache + row_offsets[std::min<int64_t>(t0 + t, last)];
#pragma GCC unroll 16
        for (int c = 0; c < kChunks; ++c) {
          const __m512 key = load_int8_lanes(key_row + c * kLanes);
#pragma GCC unroll 4
          for (int j = 0; j < kHeadsPerSweep; ++j) {
            if (j0 + j >= kGroup) break;
            const __m512 q_chunk = _mm512_loadu_ps(query_scaled + (j0 + j) * kHeadDim + c * kLanes);
            dots[j][t] = c == 0 ? _mm512_mul_ps(q_chunk, key) : _mm512_fmadd_ps(q_chunk, key, dots[j][t]);
          }
        }
      }
      for (int j = 0; j < kHeadsPerSweep; ++j) {
        if (j0 + j >= kGroup) break;
        store_scores(_mm_mul_ps(sum_lanes_of_4(dots[j][0], dots[j][1], dots[j][2], dots[j][3]), row_scales),
                     scores + (j0 + j) * score_stride + t0, count);
      }
    }
  }
  partition_softmax(g, num_tokens, scores, max_out, sum_out);
  // The value weights p * v_scale, in place (sum_out already holds the sums of the unscaled p).
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float value_scale = value_scales[scale_indices[t]];
    for (int j = 0; j < kGroup; ++j) scores[j * score_stride + t] *= value_scale;
  }

  // 2. acc[j] = sum_t (p[j][t] * v_scale_t) * v_int8_t, kChunksPerPass vectors of every head in registers.
  constexpr int kFit = kValueAccumulators / kGroup > 0 ? kValueAccumulators / kGroup : 1;
  constexpr int kChunksPerPass = kChunks <= kFit ? kChunks : kFit;
  for (int c0 = 0; c0 < kChunks; c0 += kChunksPerPass) {
    __m512 sums[kGroup][kChunksPerPass];
    for (int j = 0; j < kGroup; ++j)
      for (int c = 0; c < kChunksPerPass; ++c) sums[j][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < num_tokens; ++t) {
      if (c0 == 0) next_keys.advance(t, num_tokens);
      const int8_t* value_row = values + row_offsets[t];
#pragma GCC unroll 16
      for (int c = 0; c < kChunksPerPass; ++c) {
        if (c0 + c >= kChunks) break;
        const __m512 v = load_int8_lanes(value_row + (c0 + c) * kLanes);
#pragma GCC unroll 8
        for (int j = 0; j < kGroup; ++j)
          sums[j][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[j * score_stride + t]), v, sums[j][c]);
      }
    }
    for (int j = 0; j < kGroup; ++j)
      for (int c = 0; c < kChunksPerPass; ++c)
        if (c0 + c < kChunks) _mm512_storeu_ps(acc + j * kHeadDim + (c0 + c) * kLanes, sums[j][c]);
  }
}
#endif

template <typename query_t, typename cache_t>
using AttendFunction = void (*)(const WorkItem&, const Geometry&, const query_t*, const cache_t*, const int32_t*,
                                float, float*, float*, int64_t*, float*, float*, float*,
                                NextItemKeys&);

// The unrolled variant for (group, head_dim) when there is one, else the generic one.
template <typename query_t, typename cache_t>
AttendFunction<query_t, cache_t> select_attend(int64_t group, int64_t head_dim) {
  if constexpr (std::is_same_v<cache_t, int8_t>) {
#if defined(PAGEDSERVE_FLOAT_VECTOR) && defined(__AVX512F__)
#define PAGEDSERVE_INT8_GROUP_CASES(CHUNKS)                                              \
    switch (group) {                                                                     \
      case 1: return &attend_partition_int8_fixed<query_t, 1, CHUNKS>;                   \
      case 2: return &attend_partition_int8_fixed<query_t, 2, CHUNKS>;                   \
      case 3: return &attend_partition_int8_fixed<query_t, 3, CHUNKS>;                   \
      case 4: return &attend_partition_int8_fixed<query_t, 4, CHUNKS>;                   \
      case 5: return &attend_partition_int8_fixed<query_t, 5, CHUNKS>;                   \
      case 6: return &attend_partition_int8_fixed<query_t, 6, CHUNKS>;                   \
      case 7: return &attend_partition_int8_fixed<query_t, 7, CHUNKS>;                   \
      case 8: return &attend_partition_int8_fixed<query_t, 8, CHUNKS>;                   \
      default: break;                                                                    \
    }
    if (head_dim == 64) { PAGEDSERVE_INT8_GROUP_CASES(4) }
    if (head_dim == 128) { PAGEDSERVE_INT8_GROUP_CASES(8) }
#undef PAGEDSERVE_INT8_GROUP_CASES
#endif
    return &attend_partition_int8<query_t>;
  } else {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<query_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>) {
#define PAGEDSERVE_BF16_GROUP_CASES(CHUNKS)                                              \
    switch (group) {                                                                     \
      case 1: return &attend_partition_bf16<1, CHUNKS>;                                  \
      case 2: return &attend_partition_bf16<2, CHUNKS>;                                  \
      case 3: return &attend_partition_bf16<3, CHUNKS>;                                  \
      case 4: return &attend_partition_bf16<4, CHUNKS>;                                  \
      case 5: return &attend_partition_bf16<5, CHUNKS>;                                  \
      case 6: return &attend_partition_bf16<6, CHUNKS>;                                  \
      case 7: return &attend_partition_bf16<7, CHUNKS>;                                  \
      case 8: return &attend_partition_bf16<8, CHUNKS>;                                  \
      default: break;                                                                    \
    }
    if (head_dim == 64) { PAGEDSERVE_BF16_GROUP_CASES(4) }
    if (head_dim == 128) { PAGEDSERVE_BF16_GROUP_CASES(8) }
#undef PAGEDSERVE_BF16_GROUP_CASES
  }
#endif
#if defined(PAGEDSERVE_FLOAT_VECTOR)
#define PAGEDSERVE_GROUP_CASES(CHUNKS)                                                   \
  switch (group) {                                                                       \
    case 1: return &attend_partition_fixed<query_t, cache_t, 1, CHUNKS>;                 \
    case 2: return &attend_partition_fixed<query_t, cache_t, 2, CHUNKS>;                 \
    case 3: return &attend_partition_fixed<query_t, cache_t, 3, CHUNKS>;                 \
    case 4: return &attend_partition_fixed<query_t, cache_t, 4, CHUNKS>;                 \
    case 5: return &attend_partition_fixed<query_t, cache_t, 5, CHUNKS>;                 \
    case 6: return &attend_partition_fixed<query_t, cache_t, 6, CHUNKS>;                 \
    case 7: return &attend_partition_fixed<query_t, cache_t, 7, CHUNKS>;                 \
    case 8: return &attend_partition_fixed<query_t, cache_t, 8, CHUNKS>;                 \
    default: break;                                                                      \
  }
  if (head_dim == 64) { PAGEDSERVE_GROUP_CASES(64 / kLanes) }
  if (head_dim == 128) { PAGEDSERVE_GROUP_CASES(128 / kLanes) }
#undef PAGEDSERVE_GROUP_CASES
#endif
    return &attend_partition_generic<query_t, cache_t>;
  }
}

}  // namespace

namespace pagedserve_native {

// One call's plan and buffers (DecodeAttentionCall): the work items, the merge list, the partial results of the
// requests with several partitions, and the item / merge loops of the call's dtypes.
struct DecodeAttentionCall::State {
  at::Tensor query, kv_cache, kv_scales, block_table, out;
  Geometry g;
  std::vector<WorkItem> items;
  std::vector<int64_t> merge_items;  // the first item of every (request, kv_head) with several partitions
  std::vector<float> partials;       // [item, group, head_dim + 2]: acc, then max and sum
  float scale = 0.f;
  // The cache's data and (int8) its scales' data (nullptr: the plan's).
  void (*run_items)(const State&, const void*, const float*, int64_t, int64_t) = nullptr;
  void (*merge)(const State&, int64_t, int64_t) = nullptr;
};

}  // namespace pagedserve_native

namespace {

using DecodeState = pagedserve_native::DecodeAttentionCall::State;

// Items [begin, end) of a call: each writes its own output rows (one partition) or its own partial results.
template <typename query_t, typename cache_t>
void run_items(const DecodeState& s, const void* cache, const float* scales, int64_t begin, int64_t end) {
  Geometry g = s.g;
  if (scales != nullptr) g.scales = scales;
  const query_t* query_data = s.query.data_ptr<query_t>();
  const cache_t* cache_data = static_cast<const cache_t*>(cache);
  const int32_t* table_data = s.block_table.data_ptr<int32_t>();
  query_t* out_data = s.out.data_ptr<query_t>();
  const int64_t group = g.group;
  const int64_t head_dim = g.head_dim;
  const int64_t partial_stride = group * (head_dim + 2);
  // The partials are written by disjoint items only (const State: shared between threads).
  float* partials = const_cast<float*>(s.partials.data());
  const AttendFunction<query_t, cache_t> attend = select_attend<query_t, cache_t>(group, head_dim);
  std::vector<float> scratch(group * head_dim + group * g.partition_size + group * (head_dim + 2));
  // int8 caches: the rows' offsets, then their scales' indices (attend_partition_int8_fixed).
  std::vector<int64_t> row_offsets(g.partition_size * (std::is_same_v<cache_t, int8_t> ? 2 : 1));
  std::vector<int64_t> next_row_offsets(g.partition_size);
  float* query_scaled = scratch.data();
  float* scores = query_scaled + group * head_dim;
  float* local = scores + group * g.partition_size;
  for (int64_t index = begin; index < end; ++index) {
    const WorkItem& item = s.items[index];
    float* partial = item.num_partitions == 1 ? local : partials + index * partial_stride;
    float* acc = partial;
    float* maxima = partial + group * head_dim;
    float* sums = maxima + group;
    NextItemKeys next_keys;
    if (index + 1 < end)
      next_keys = plan_next_item_keys(s.items[index + 1], g, table_data, cache_data, next_row_offsets.data());
    attend(item, g, query_data, cache_data, table_data, s.scale, query_scaled, scores, row_offsets.data(), acc,
           maxima, sums, next_keys);
    if (item.num_partitions == 1) {
      query_t* destination = out_data + (item.request * g.num_heads + item.kv_head * group) * head_dim;
      for (int64_t j = 0; j < group; ++j)
        for (int64_t d = 0; d < head_dim; ++d)
          destination[j * head_dim + d] = from_float<query_t>(acc[j * head_dim + d] / sums[j]);
    }
  }
}

// Merges [begin, end) of the call's merge list: each (request, kv_head)'s partitions, in partition order.
template <typename query_t, typename cache_t>
void merge_partitions(const DecodeState& s, int64_t begin, int64_t end) {
  const Geometry& g = s.g;
  const int64_t group = g.group;
  const int64_t head_dim = g.head_dim;
  const int64_t partial_stride = group * (head_dim + 2);
  const std::vector<float>& partials = s.partials;
  query_t* out_data = s.out.data_ptr<query_t>();
  std::vector<float> merged(head_dim);
  for (int64_t index = begin; index < end; ++index) {
    const int64_t first = s.merge_items[index];
    const WorkItem& head_item = s.items[first];
    const int64_t count = head_item.num_partitions;
    query_t* destination = out_data + (head_item.request * g.num_heads + head_item.kv_head * group) * head_dim;
    for (int64_t j = 0; j < group; ++j) {
      float maximum = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < count; ++p)
        maximum = std::max(maximum, partials[(first + p) * partial_stride + group * head_dim + j]);
      float total = 0.f;
      std::fill(merged.begin(), merged.end(), 0.f);
      for (int64_t p = 0; p < count; ++p) {
        const float* partial = partials.data() + (first + p) * partial_stride;
        const float weight = std::exp(partial[group * head_dim + j] - maximum);
        total += weight * partial[group * head_dim + group + j];
        const float* acc = partial + j * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) merged[d] += weight * acc[d];
      }
      for (int64_t d = 0; d < head_dim; ++d)
        destination[j * head_dim + d] = from_float<query_t>(merged[d] / total);
    }
  }
}

template <typename query_t, typename cache_t>
void select_loops(DecodeState& s) {
  s.run_items = &run_items<query_t, cache_t>;
  s.merge = &merge_partitions<query_t, cache_t>;
}

}  // namespace

namespace pagedserve_native {

DecodeAttentionCall::DecodeAttentionCall(const at::Tensor& query, const at::Tensor& kv_cache,
                                         const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                                         std::optional<int64_t> sliding_window, int64_t partition_size, at::Tensor out)
    : DecodeAttentionCall(query, kv_cache, std::nullopt, block_table, seq_lens, scale, sliding_window,
                          partition_size, std::move(out)) {}

DecodeAttentionCall::DecodeAttentionCall(const at::Tensor& query, const at::Tensor& kv_cache,
                                         const std::optional<at::Tensor>& kv_scales, const at::Tensor& block_table,
                                         const at::Tensor& seq_lens, double scale,
                                         std::optional<int64_t> sliding_window, int64_t partition_size, at::Tensor out)
    : state_(std::make_unique<State>()) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu() && block_table.device().is_cpu() &&
                  seq_lens.device().is_cpu(),
              "paged_decode_attention: every tensor must be on the CPU");
  TORCH_CHECK(query.dim() == 3, "paged_decode_attention: query must be [num_decodes, num_heads, head_dim]");
  const bool is_int8 = kv_cache.scalar_type() == at::kChar;
  if (is_int8) {
    // The int8 view of byte pages: rows contiguous within a block, blocks and planes at any stride.
    TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.stride(4) == 1 &&
                    kv_cache.stride(3) == kv_cache.size(4) && kv_cache.stride(2) == kv_cache.size(3) * kv_cache.size(4),
                "paged_decode_attention_int8: kv_cache must be an int8 [2, num_blocks, block_size, num_kv_heads, "
                "head_dim] view with contiguous blocks");
    TORCH_CHECK(kv_scales.has_value() && kv_scales->scalar_type() == at::kFloat && kv_scales->dim() == 4 &&
                    kv_scales->sizes() == kv_cache.sizes().slice(0, 4) && kv_scales->stride(3) == 1 &&
                    kv_scales->device().is_cpu(),
                "paged_decode_attention_int8: kv_scales must be a float32 [2, num_blocks, block_size, num_kv_heads] "
                "CPU view with contiguous heads");
  } else {
    TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
                "paged_decode_attention: kv_cache must be a contiguous [2, num_blocks, block_size, num_kv_heads, "
                "head_dim] tensor");
    TORCH_CHECK(!kv_scales.has_value(), "paged_decode_attention: kv_scales are for an int8 kv_cache only");
  }
  TORCH_CHECK(query.stride(2) == 1, "paged_decode_attention: query's head_dim must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.stride(1) == 1,
              "paged_decode_attention: block_table must be int32 [num_decodes, max_blocks] with contiguous rows");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1,
              "paged_decode_attention: seq_lens must be int32 [num_decodes]");
  TORCH_CHECK(partition_size >= 1, "paged_decode_attention: partition_size must be >= 1");
  const int64_t num_decodes = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = query.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == head_dim, "paged_decode_attention: head_dim mismatch");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "paged_decode_attention: num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_table.size(0) >= num_decodes && seq_lens.size(0) >= num_decodes,
              "paged_decode_attention: block_table and seq_lens need a row per decode");
  const int64_t window = sliding_window.has_value() ? *sliding_window : 0;
  TORCH_CHECK(window >= 0, "paged_decode_attention: sliding_window must be >= 1 or None");
  const auto query_type = query.scalar_type();
  const auto cache_type = kv_cache.scalar_type();
  TORCH_CHECK(query_type == at::kFloat || query_type == at::kBFloat16,
              "paged_decode_attention: query must be float32 or bfloat16");
  TORCH_CHECK(cache_type == at::kFloat || cache_type == at::kBFloat16 || cache_type == at::kChar,
              "paged_decode_attention: kv_cache must be float32, bfloat16 or (with kv_scales) int8");
  TORCH_CHECK(out.scalar_type() == query_type && out.is_contiguous() &&
                  out.sizes() == at::IntArrayRef({num_decodes, num_heads, head_dim}),
              "paged_decode_attention: out must be a contiguous [num_decodes, num_heads, head_dim] tensor of the "
              "query's dtype");

  State& s = *state_;
  s.query = query;
  s.kv_cache = kv_cache;
  s.block_table = block_table;
  s.out = std::move(out);
  s.scale = static_cast<float>(scale);
  Geometry& g = s.g;
  g.num_heads = num_heads;
  g.num_kv_heads = num_kv_heads;
  g.group = num_heads / num_kv_heads;
  g.head_dim = head_dim;
  g.block_size = kv_cache.size(2);
  g.num_blocks = kv_cache.size(1);
  // For a contiguous cache these are num_kv_heads * head_dim, block_size * that and num_blocks * that.
  g.token_stride = kv_cache.stride(2);
  g.block_stride = kv_cache.stride(1);
  g.value_offset = kv_cache.stride(0);
  if (is_int8) {
    s.kv_scales = *kv_scales;
    g.scales = kv_scales->data_ptr<float>();
    g.scale_token_stride = kv_scales->stride(2);
    g.scale_block_stride = kv_scales->stride(1);
    g.scale_value_offset = kv_scales->stride(0);
  }
  g.query_token_stride = query.stride(0);
  g.query_head_stride = query.stride(1);
  g.table_stride = block_table.stride(0);
  g.partition_size = partition_size;

  // Work items in (request, kv_head, partition) order.
  const int32_t* lengths = seq_lens.data_ptr<int32_t>();
  s.items.reserve(num_decodes * num_kv_heads);
  for (int64_t request = 0; request < num_decodes; ++request) {
    const int64_t seq_len = lengths[request];
    TORCH_CHECK(seq_len >= 1, "paged_decode_attention: seq_lens[", request, "]=", seq_len, " must be >= 1");
    TORCH_CHECK((seq_len + g.block_size - 1) / g.block_size <= block_table.size(1), "paged_decode_attention: ",
                "seq_lens[", request, "]=", seq_len, " needs more blocks than block_table has columns");
    const int64_t first = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
    const int64_t first_partition = first / partition_size;
    const int64_t last_partition = (seq_len - 1) / partition_size;
    const int32_t num_partitions = static_cast<int32_t>(last_partition - first_partition + 1);
    for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
      if (num_partitions > 1) s.merge_items.push_back(static_cast<int64_t>(s.items.size()));
      for (int64_t partition = first_partition; partition <= last_partition; ++partition) {
        const int64_t begin = std::max(first, partition * partition_size);
        const int64_t end = std::min(seq_len, (partition + 1) * partition_size);
        s.items.push_back(WorkItem{static_cast<int32_t>(request), static_cast<int32_t>(kv_head),
                                   static_cast<int32_t>(begin), static_cast<int32_t>(end), num_partitions,
                                   static_cast<int32_t>(partition - first_partition)});
      }
    }
  }
  if (!s.merge_items.empty()) s.partials.resize(s.items.size() * g.group * (head_dim + 2));
  if (is_int8 && query_type == at::kFloat) select_loops<float, int8_t>(s);
  else if (is_int8) select_loops<c10::BFloat16, int8_t>(s);
  else if (query_type == at::kFloat && cache_type == at::kFloat) select_loops<float, float>(s);
  else if (query_type == at::kFloat) select_loops<float, c10::BFloat16>(s);
  else if (cache_type == at::kFloat) select_loops<c10::BFloat16, float>(s);
  else select_loops<c10::BFloat16, c10::BFloat16>(s);
}

DecodeAttentionCall::~DecodeAttentionCall() = default;

int64_t DecodeAttentionCall::num_items() const { return static_cast<int64_t>(state_->items.size()); }

int64_t DecodeAttentionCall::num_merges() const { return static_cast<int64_t>(state_->merge_items.size()); }

void DecodeAttentionCall::run_items(int64_t begin, int64_t end) const {
  state_->run_items(*state_, state_->kv_cache.data_ptr(), nullptr, begin, end);
}

void DecodeAttentionCall::run_items_on(const at::Tensor& kv_cache, int64_t begin, int64_t end) const {
  state_->run_items(*state_, kv_cache.data_ptr(), nullptr, begin, end);
}

void DecodeAttentionCall::run_items_on(const at::Tensor& kv_cache, const at::Tensor& kv_scales, int64_t begin,
                                       int64_t end) const {
  TORCH_CHECK(state_->g.scales != nullptr, "DecodeAttentionCall.run_items_on: scales given to a plan of a float cache");
  state_->run_items(*state_, kv_cache.data_ptr(), kv_scales.data_ptr<float>(), begin, end);
}

void DecodeAttentionCall::merge(int64_t begin, int64_t end) const { state_->merge(*state_, begin, end); }

}  // namespace pagedserve_native

namespace {

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                                  const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                                  std::optional<int64_t> sliding_window, int64_t partition_size) {
  TORCH_CHECK(query.dim() == 3, "paged_decode_attention: query must be [num_decodes, num_heads, head_dim]");
  at::Tensor out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  const pagedserve_native::DecodeAttentionCall call(query, kv_cache, block_table, seq_lens, scale, sliding_window,
                                                    partition_size, out);
  if (call.num_items() == 0) return out;
  at::parallel_for(0, call.num_items(), 1, [&](int64_t begin, int64_t end) { call.run_items(begin, end); });
  if (call.num_merges() > 0)
    at::parallel_for(0, call.num_merges(), 1, [&](int64_t begin, int64_t end) { call.merge(begin, end); });
  return out;
}

at::Tensor paged_decode_attention_int8(const at::Tensor& query, const at::Tensor& kv_cache,
                                       const at::Tensor& kv_scales, const at::Tensor& block_table,
                                       const at::Tensor& seq_lens, double scale, std::optional<int64_t> sliding_window,
                                       int64_t partition_size) {
  TORCH_CHECK(query.dim() == 3, "paged_decode_attention_int8: query must be [num_decodes, num_heads, head_dim]");
  TORCH_CHECK(kv_cache.scalar_type() == at::kChar, "paged_decode_attention_int8: kv_cache must be int8");
  at::Tensor out = at::empty({query.size(0), query.size(1), query.size(2)}, query.options());
  const pagedserve_native::DecodeAttentionCall call(query, kv_cache, kv_scales, block_table, seq_lens, scale,
                                                    sliding_window, partition_size, out);
  if (call.num_items() == 0) return out;
  at::parallel_for(0, call.num_items(), 1, [&](int64_t begin, int64_t end) { call.run_items(begin, end); });
  if (call.num_merges() > 0)
    at::parallel_for(0, call.num_merges(), 1, [&](int64_t begin, int64_t end) { call.merge(begin, end); });
  return out;
}


// ---- K/V cache write (reshape_and_cache) ----

#if defined(__AVX512F__)
// Round-to-nearest-even float32 -> bfloat16 for 16 lanes: ATen's vectorised conversion (vec512_bfloat16.h
// cvtfp32_bf16), so the bits equal Tensor.to(torch.bfloat16)'s. NaN lanes become 0xffff (a NaN), as there.
inline void store_bfloat16_lanes(c10::BFloat16* destination, __m512 source) {
  const __m512i bits = _mm512_castps_si512(source);
  const __mmask16 ordered = _mm512_cmp_ps_mask(source, source, _CMP_ORD_Q);
  __m512i rounded = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));  // lsb of the result
  rounded = _mm512_add_epi32(rounded, _mm512_set1_epi32(0x7fff));                          // + rounding bias
  rounded = _mm512_srli_epi32(_mm512_add_epi32(rounded, bits), 16);
  rounded = _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0xffff), rounded);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(destination), _mm512_cvtusepi32_epi16(rounded));
}
#elif defined(PAGEDSERVE_AVX2)
// The same for 8 lanes: ATen's AVX2 conversion (vec256_16bit_float.h cvtfp32_bf16), NaN lanes 0xffff.
inline void store_bfloat16_lanes(c10::BFloat16* destination, __m256 source) {
  const __m256i bits = _mm256_castps_si256(source);
  const __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(source, source, _CMP_ORD_Q));
  __m256i rounded = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));  // lsb of the result
  rounded = _mm256_add_epi32(rounded, _mm256_set1_epi32(0x7fff));                          // + rounding bias
  rounded = _mm256_srli_epi32(_mm256_add_epi32(rounded, bits), 16);
  rounded = _mm256_blendv_epi8(_mm256_set1_epi32(0xffff), rounded, ordered);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(destination), pagedserve_native::pack_bfloat16(rounded));
}
#endif

// Copies `count` contiguous elements, converting the dtype when the two differ.
template <typename source_t, typename destination_t>
inline void convert_row(const source_t* source, destination_t* destination, int64_t count) {
  if constexpr (std::is_same_v<source_t, destination_t>) {
    std::memcpy(destination, source, count * sizeof(source_t));
  } else {
    int64_t index = 0;
#if defined(PAGEDSERVE_FLOAT_VECTOR)
    if constexpr (std::is_same_v<source_t, float> && std::is_same_v<destination_t, c10::BFloat16>) {
      for (; index + kLanes <= count; index += kLanes)
        store_bfloat16_lanes(destination + index, Vec::load(source + index));
    } else {
      for (; index + kLanes <= count; index += kLanes) Vec::store(destination + index, Vec::load(source + index));
    }
#endif
    // c10's scalar conversions: round to nearest even / exact widening.
    for (; index < count; ++index) destination[index] = static_cast<destination_t>(to_float(source[index]));
  }
}

// One token's rows of one plane (K or V): [num_kv_heads, head_dim] from `source` (any strides) into the
// contiguous cache slot `destination`.
template <typename input_t, typename cache_t>
inline void write_slot(const input_t* source, int64_t head_stride, int64_t element_stride, int64_t num_kv_heads,
                       int64_t head_dim, cache_t* destination) {
  if (element_stride != 1) {  // not produced by the model layers; kept so that any view is accepted
    for (int64_t head = 0; head < num_kv_heads; ++head)
      for (int64_t d = 0; d < head_dim; ++d)
        destination[head * head_dim + d] =
            static_cast<cache_t>(to_float(source[head * head_stride + d * element_stride]));
  } else if (head_stride == head_dim || num_kv_heads == 1) {
    // A token's heads back to back (fresh tensors and the fused-QKV views alike): one run.
    convert_row(source, destination, num_kv_heads * head_dim);
  } else {
    for (int64_t head = 0; head < num_kv_heads; ++head)
      convert_row(source + head * head_stride, destination + head * head_dim, head_dim);
  }
}

template <typename input_t, typename cache_t>
void write_rows(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const int64_t* slots,
                int64_t slot_stride) {
  const int64_t num_tokens = key.size(0);
  const int64_t num_kv_heads = key.size(1);
  const int64_t head_dim = key.size(2);
  const int64_t token_elements = num_kv_heads * head_dim;  // one slot of one plane
  const int64_t value_offset = kv_cache.size(1) * kv_cache.size(2) * token_elements;
  const input_t* key_data = key.data_ptr<input_t>();
  const input_t* value_data = value.data_ptr<input_t>();
  cache_t* cache_data = kv_cache.data_ptr<cache_t>();
  const int64_t key_strides[3] = {key.stride(0), key.stride(1), key.stride(2)};
  const int64_t value_strides[3] = {value.stride(0), value.stride(1), value.stride(2)};
  // Threads only pay off for large writes (prefill): a decode step's few KB stay on the calling thread.
  const int64_t bytes_per_token = 2 * token_elements * static_cast<int64_t>(sizeof(cache_t));
  const int64_t grain = std::max<int64_t>(1, (int64_t{256} << 10) / bytes_per_token);
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t token = begin; token < end; ++token) {
      const int64_t slot = slots[token * slot_stride];
      if (slot < 0) continue;  // padding
      cache_t* key_destination = cache_data + slot * token_elements;
      write_slot(key_data + token * key_strides[0], key_strides[1], key_strides[2], num_kv_heads, head_dim,
                 key_destination);
      write_slot(value_data + token * value_strides[0], value_strides[1], value_strides[2], num_kv_heads,
                 head_dim, key_destination + value_offset);
    }
  });
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                       const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && kv_cache.device().is_cpu() &&
                  slot_mapping.device().is_cpu(),
              "reshape_and_cache: every tensor must be on the CPU");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(),
              "reshape_and_cache: key and value must both be [num_tokens, num_kv_heads, head_dim]");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "reshape_and_cache: key and value dtypes differ");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "reshape_and_cache: kv_cache must be a contiguous [2, num_blocks, block_size, num_kv_heads, "
              "head_dim] tensor");
  TORCH_CHECK(kv_cache.size(3) == key.size(1) && kv_cache.size(4) == key.size(2),
              "reshape_and_cache: kv_cache's [num_kv_heads, head_dim] ", kv_cache.sizes().slice(3),
              " must match key's ", key.sizes().slice(1));
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == key.size(0),
              "reshape_and_cache: slot_mapping must be int64 [num_tokens]");
  const auto input_type = key.scalar_type();
  const auto cache_type = kv_cache.scalar_type();
  TORCH_CHECK(input_type == at::kFloat || input_type == at::kBFloat16,
              "reshape_and_cache: key/value must be float32 or bfloat16");
  TORCH_CHECK(cache_type == at::kFloat || cache_type == at::kBFloat16,
              "reshape_and_cache: kv_cache must be float32 or bfloat16");
  // Every slot is checked before anything is written: a bad slot leaves the cache untouched.
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t slot_stride = slot_mapping.stride(0);
  for (int64_t token = 0; token < key.size(0); ++token) {
    const int64_t slot = slots[token * slot_stride];
    TORCH_CHECK(slot < num_slots, "reshape_and_cache: slot_mapping[", token, "]=", slot, " is out of range [0, ",
                num_slots, ")");
  }
  if (key.size(0) == 0 || key.numel() == 0) return;
  if (input_type == at::kFloat && cache_type == at::kFloat)
    write_rows<float, float>(key, value, kv_cache, slots, slot_stride);
  else if (input_type == at::kFloat)
    write_rows<float, c10::BFloat16>(key, value, kv_cache, slots, slot_stride);
  else if (cache_type == at::kFloat)
    write_rows<c10::BFloat16, float>(key, value, kv_cache, slots, slot_stride);
  else
    write_rows<c10::BFloat16, c10::BFloat16>(key, value, kv_cache, slots, slot_stride);
}

// One row (head_dim values, any element stride) quantized into `destination`; returns its scale.
template <typename input_t>
inline float quantize_row(const input_t* source, int64_t element_stride, int64_t head_dim, int8_t* destination) {
  float absmax = 0.f;
  for (int64_t d = 0; d < head_dim; ++d) absmax = std::max(absmax, std::fabs(to_float(source[d * element_stride])));
  const float row_scale = absmax / 127.f;
  if (!(row_scale > 0.f)) {
    std::memset(destination, 0, static_cast<size_t>(head_dim));
    return row_scale;
  }
  for (int64_t d = 0; d < head_dim; ++d) {
    // Division (not a reciprocal product) and round-half-even: the reference's torch.round(x / scale) bit for bit.
    const float rounded = std::nearbyint(to_float(source[d * element_stride]) / row_scale);
    destination[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, rounded)));
  }
  return row_scale;
}

template <typename input_t>
void write_int8_rows(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, at::Tensor& kv_scales,
                     const int64_t* slots, int64_t slot_stride) {
  const int64_t num_tokens = key.size(0);
  const int64_t num_kv_heads = key.size(1);
  const int64_t head_dim = key.size(2);
  const int64_t block_size = kv_cache.size(2);
  const int64_t cache_strides[3] = {kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2)};
  const int64_t scale_strides[3] = {kv_scales.stride(0), kv_scales.stride(1), kv_scales.stride(2)};
  int8_t* cache_data = kv_cache.data_ptr<int8_t>();
  float* scale_data = kv_scales.data_ptr<float>();
  const at::Tensor* sources[2] = {&key, &value};
  const int64_t grain = std::max<int64_t>(1, (int64_t{256} << 10) / (2 * num_kv_heads * head_dim));
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t token = begin; token < end; ++token) {
      const int64_t slot = slots[token * slot_stride];
      if (slot < 0) continue;  // padding
      const int64_t block_id = slot / block_size;
      const int64_t in_block = slot % block_size;
      for (int64_t plane = 0; plane < 2; ++plane) {
        const at::Tensor& source = *sources[plane];
        const input_t* row = source.data_ptr<input_t>() + token * source.stride(0);
        int8_t* destination = cache_data + plane * cache_strides[0] + block_id * cache_strides[1] +
                              in_block * cache_strides[2];
        float* scales = scale_data + plane * scale_strides[0] + block_id * scale_strides[1] +
                        in_block * scale_strides[2];
        for (int64_t head = 0; head < num_kv_heads; ++head)
          scales[head] = quantize_row(row + head * source.stride(1), source.stride(2), head_dim,
                                      destination + head * head_dim);
      }
    }
  });
}

void reshape_and_cache_int8(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                            at::Tensor& kv_scales, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && kv_cache.device().is_cpu() &&
                  kv_scales.device().is_cpu() && slot_mapping.device().is_cpu(),
              "reshape_and_cache_int8: every tensor must be on the CPU");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(),
              "reshape_and_cache_int8: key and value must both be [num_tokens, num_kv_heads, head_dim]");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "reshape_and_cache_int8: key and value dtypes differ");
  TORCH_CHECK(kv_cache.scalar_type() == at::kChar && kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
                  kv_cache.stride(4) == 1 && kv_cache.stride(3) == kv_cache.size(4),
              "reshape_and_cache_int8: kv_cache must be an int8 [2, num_blocks, block_size, num_kv_heads, head_dim] "
              "view with contiguous rows");
  TORCH_CHECK(kv_cache.size(3) == key.size(1) && kv_cache.size(4) == key.size(2),
              "reshape_and_cache_int8: kv_cache's [num_kv_heads, head_dim] ", kv_cache.sizes().slice(3),
              " must match key's ", key.sizes().slice(1));
  TORCH_CHECK(kv_scales.scalar_type() == at::kFloat && kv_scales.dim() == 4 &&
                  kv_scales.sizes() == kv_cache.sizes().slice(0, 4) && kv_scales.stride(3) == 1,
              "reshape_and_cache_int8: kv_scales must be a float32 [2, num_blocks, block_size, num_kv_heads] view");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == key.size(0),
              "reshape_and_cache_int8: slot_mapping must be int64 [num_tokens]");
  const auto input_type = key.scalar_type();
  TORCH_CHECK(input_type == at::kFloat || input_type == at::kBFloat16,
              "reshape_and_cache_int8: key/value must be float32 or bfloat16");
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t slot_stride = slot_mapping.stride(0);
  for (int64_t token = 0; token < key.size(0); ++token) {
    const int64_t slot = slots[token * slot_stride];
    TORCH_CHECK(slot < num_slots, "reshape_and_cache_int8: slot_mapping[", token, "]=", slot,
                " is out of range [0, ", num_slots, ")");
  }
  if (key.size(0) == 0 || key.numel() == 0) return;
  if (input_type == at::kFloat) write_int8_rows<float>(key, value, kv_cache, kv_scales, slots, slot_stride);
  else write_int8_rows<c10::BFloat16>(key, value, kv_cache, kv_scales, slots, slot_stride);
}

}  // namespace

namespace pagedserve_native {

float quantize_int8_row(const float* source, int64_t head_dim, int8_t* destination) {
  return quantize_row(source, 1, head_dim, destination);
}

float quantize_int8_row(const c10::BFloat16* source, int64_t head_dim, int8_t* destination) {
  return quantize_row(source, 1, head_dim, destination);
}

}  // namespace pagedserve_native

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("paged_decode_attention(Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, float scale, "
        "int? sliding_window, int partition_size) -> Tensor");
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def("paged_decode_attention_int8(Tensor query, Tensor kv_cache, Tensor kv_scales, Tensor block_table, "
        "Tensor seq_lens, float scale, int? sliding_window, int partition_size) -> Tensor");
  m.def("reshape_and_cache_int8(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor(b!) kv_scales, "
        "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("reshape_and_cache", &reshape_and_cache);
  m.impl("paged_decode_attention_int8", &paged_decode_attention_int8);
  m.impl("reshape_and_cache_int8", &reshape_and_cache_int8);
}
