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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float to_float(float value) { return value; }
inline float to_float(c10::BFloat16 value) { return static_cast<float>(value); }

template <typename scalar_t>
inline scalar_t from_float(float value) { return static_cast<scalar_t>(value); }

#if defined(__AVX512F__)
constexpr int kLanes = 16;

inline __m512 load16(const float* pointer) { return _mm512_loadu_ps(pointer); }

inline __m512 load16(const c10::BFloat16* pointer) {
  // bf16 is the upper half of an fp32: widen to 32 bits and shift into place (exact).
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pointer));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp(x) to about 1 ulp (Cephes expf: x = n ln2 + r, |r| <= ln2 / 2, degree-6 polynomial in r).
// Inputs here are s - max(s) <= 0; below ln(FLT_MIN) the result is flushed to 0.
inline __m512 exp16(__m512 x) {
  const __m512 ln_min = _mm512_set1_ps(-87.33654475f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, ln_min, _CMP_LT_OQ);
  x = _mm512_max_ps(x, ln_min);
  x = _mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  // 2^n: scalef handles the exponent without integer tricks.
  __m512 result = _mm512_scalef_ps(p, n);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow), result);
}
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
#if defined(__AVX512F__)
    __m512 maxima = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + kLanes <= num_tokens; t += kLanes) maxima = _mm512_max_ps(maxima, _mm512_loadu_ps(row + t));
    maximum = _mm512_reduce_max_ps(maxima);
    for (; t < num_tokens; ++t) maximum = std::max(maximum, row[t]);
    const __m512 shift = _mm512_set1_ps(maximum);
    __m512 totals = _mm512_setzero_ps();
    for (t = 0; t < num_tokens; t += kLanes) {
      const __mmask16 mask = num_tokens - t >= kLanes ? static_cast<__mmask16>(0xFFFF)
                                                      : static_cast<__mmask16>((1u << (num_tokens - t)) - 1);
      const __m512 p = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, row + t), shift));
      _mm512_mask_storeu_ps(row + t, mask, p);
      totals = _mm512_add_ps(totals, _mm512_maskz_mov_ps(mask, p));
    }
    total = _mm512_reduce_add_ps(totals);
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
// The generic path: any group size and head_dim (AVX-512 when head_dim is a multiple of 16, else scalar).
template <typename query_t, typename cache_t>
void attend_partition_generic(const WorkItem& item, const Geometry& g, const query_t* query, const cache_t* cache,
                              const int32_t* block_table, float scale, float* query_scaled, float* scores,
                              float* acc, float* max_out, float* sum_out) {
  const int64_t group = g.group;
  const int64_t head_dim = g.head_dim;
  const int64_t num_tokens = item.token_end - item.token_begin;
  const int64_t score_stride = g.partition_size;
  stage_query(item, g, query, scale, query_scaled);
  const int32_t* table_row = block_table + item.request * g.table_stride;
#if defined(__AVX512F__)
  const bool vectorized = head_dim % kLanes == 0;
#else
  const bool vectorized = false;
#endif
  // 1. scores[j][t] = (q_j * scale) . k_t
  for_each_row(g, table_row, item.kv_head, item.token_begin, item.token_end, cache, [&](int64_t t, int64_t offset) {
    const cache_t* key = cache + offset;
    if (vectorized) {
#if defined(__AVX512F__)
      for (int64_t j = 0; j < group; ++j) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t d = 0; d < head_dim; d += kLanes)
          sum = _mm512_fmadd_ps(_mm512_loadu_ps(query_scaled + j * head_dim + d), load16(key + d), sum);
        scores[j * score_stride + t] = _mm512_reduce_add_ps(sum);
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
    const cache_t* value = cache + g.value_offset + offset;
    for (int64_t j = 0; j < group; ++j) {
      const float p = scores[j * score_stride + t];
      float* out = acc + j * head_dim;
      if (vectorized) {
#if defined(__AVX512F__)
        for (int64_t d = 0; d < head_dim; d += kLanes)
          _mm512_storeu_ps(out + d, _mm512_fmadd_ps(_mm512_set1_ps(p), load16(value + d), _mm512_loadu_ps(out + d)));
#endif
      } else {
        for (int64_t d = 0; d < head_dim; ++d) out[d] += p * to_float(value[d]);
      }
    }
  });
}

#if defined(__AVX512F__)
// The fast path for a compile-time group size kGroup and head_dim = 16 * kChunks: fully unrolled, with
// the value accumulators in registers. Same summation order per lane as the generic AVX-512 path.
template <typename query_t, typename cache_t, int kGroup, int kChunks>
void attend_partition_fixed(const WorkItem& item, const Geometry& g, const query_t* query, const cache_t* cache,
                            const int32_t* block_table, float scale, float* query_scaled, float* scores,
                            float* acc, float* max_out, float* sum_out) {
  constexpr int kHeadDim = kChunks * kLanes;
  const int64_t num_tokens = item.token_end - item.token_begin;
  const int64_t score_stride = g.partition_size;
  stage_query(item, g, query, scale, query_scaled);
  const int32_t* table_row = block_table + item.request * g.table_stride;
  for_each_row(g, table_row, item.kv_head, item.token_begin, item.token_end, cache, [&](int64_t t, int64_t offset) {
    const cache_t* key = cache + offset;
    __m512 k[kChunks];
    for (int c = 0; c < kChunks; ++c) k[c] = load16(key + c * kLanes);
    for (int j = 0; j < kGroup; ++j) {
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < kChunks; ++c)
        sum = _mm512_fmadd_ps(_mm512_loadu_ps(query_scaled + j * kHeadDim + c * kLanes), k[c], sum);
      scores[j * score_stride + t] = _mm512_reduce_add_ps(sum);
    }
  });
  partition_softmax(g, num_tokens, scores, max_out, sum_out);
  // Accumulators for kChunksPerPass chunks of every head stay in registers over the whole partition.
  constexpr int kChunksPerPass = kChunks < 24 / kGroup ? kChunks : (24 / kGroup > 0 ? 24 / kGroup : 1);
  for (int c0 = 0; c0 < kChunks; c0 += kChunksPerPass) {
    __m512 sums[kGroup][kChunksPerPass];
    for (int j = 0; j < kGroup; ++j)
      for (int c = 0; c < kChunksPerPass; ++c) sums[j][c] = _mm512_setzero_ps();
    for_each_row(g, table_row, item.kv_head, item.token_begin, item.token_end, static_cast<const cache_t*>(nullptr),
                 [&](int64_t t, int64_t offset) {
      const cache_t* value = cache + g.value_offset + offset + c0 * kLanes;
      __m512 v[kChunksPerPass];
      for (int c = 0; c < kChunksPerPass; ++c)
        if (c0 + c < kChunks) v[c] = load16(value + c * kLanes);
      for (int j = 0; j < kGroup; ++j) {
        const __m512 p = _mm512_set1_ps(scores[j * score_stride + t]);
        for (int c = 0; c < kChunksPerPass; ++c)
          if (c0 + c < kChunks) sums[j][c] = _mm512_fmadd_ps(p, v[c], sums[j][c]);
      }
    });
    for (int j = 0; j < kGroup; ++j)
      for (int c = 0; c < kChunksPerPass; ++c)
        if (c0 + c < kChunks) _mm512_storeu_ps(acc + j * kHeadDim + (c0 + c) * kLanes, sums[j][c]);
  }
}
#endif

template <typename query_t, typename cache_t>
using AttendFunction = void (*)(const WorkItem&, const Geometry&, const query_t*, const cache_t*, const int32_t*,
                                float, float*, float*, float*, float*, float*);

// The unrolled variant for (group, head_dim) when there is one, else the generic one.
template <typename query_t, typename cache_t>
AttendFunction<query_t, cache_t> select_attend(int64_t group, int64_t head_dim) {
#if defined(__AVX512F__)
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
  if (head_dim == 64) { PAGEDSERVE_GROUP_CASES(4) }
  if (head_dim == 128) { PAGEDSERVE_GROUP_CASES(8) }
#undef PAGEDSERVE_GROUP_CASES
#endif
  return &attend_partition_generic<query_t, cache_t>;
}

template <typename query_t, typename cache_t>
void run_decode(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                const std::vector<WorkItem>& items, const std::vector<int64_t>& merge_items, const Geometry& g,
                double scale, at::Tensor& out) {
  const query_t* query_data = query.data_ptr<query_t>();
  const cache_t* cache_data = kv_cache.data_ptr<cache_t>();
  const int32_t* table_data = block_table.data_ptr<int32_t>();
  query_t* out_data = out.data_ptr<query_t>();
  const int64_t group = g.group;
  const int64_t head_dim = g.head_dim;
  const int64_t num_items = static_cast<int64_t>(items.size());
  // Partial results of items whose request has several partitions: [item, group, head_dim + 2]
  // (acc, then max and sum).
  const int64_t partial_stride = group * (head_dim + 2);
  std::vector<float> partials(merge_items.empty() ? 0 : num_items * partial_stride);
  const float scale_f = static_cast<float>(scale);
  const AttendFunction<query_t, cache_t> attend = select_attend<query_t, cache_t>(group, head_dim);

  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(group * head_dim + group * g.partition_size + group * (head_dim + 2));
    float* query_scaled = scratch.data();
    float* scores = query_scaled + group * head_dim;
    float* local = scores + group * g.partition_size;
    for (int64_t index = begin; index < end; ++index) {
      const WorkItem& item = items[index];
      float* partial = item.num_partitions == 1 ? local : partials.data() + index * partial_stride;
      float* acc = partial;
      float* maxima = partial + group * head_dim;
      float* sums = maxima + group;
      attend(item, g, query_data, cache_data, table_data, scale_f, query_scaled, scores, acc, maxima, sums);
      if (item.num_partitions == 1) {
        query_t* destination = out_data + (item.request * g.num_heads + item.kv_head * group) * head_dim;
        for (int64_t j = 0; j < group; ++j)
          for (int64_t d = 0; d < head_dim; ++d)
            destination[j * head_dim + d] = from_float<query_t>(acc[j * head_dim + d] / sums[j]);
      }
    }
  });

  if (merge_items.empty()) return;
  // Merge: for each (request, kv_head) with several partitions, in partition order.
  at::parallel_for(0, static_cast<int64_t>(merge_items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(head_dim);
    for (int64_t index = begin; index < end; ++index) {
      const int64_t first = merge_items[index];
      const WorkItem& head_item = items[first];
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
  });
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                                  const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                                  std::optional<int64_t> sliding_window, int64_t partition_size) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu() && block_table.device().is_cpu() &&
                  seq_lens.device().is_cpu(),
              "paged_decode_attention: every tensor must be on the CPU");
  TORCH_CHECK(query.dim() == 3, "paged_decode_attention: query must be [num_decodes, num_heads, head_dim]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "paged_decode_attention: kv_cache must be a contiguous [2, num_blocks, block_size, num_kv_heads, "
              "head_dim] tensor");
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

  Geometry g;
  g.num_heads = num_heads;
  g.num_kv_heads = num_kv_heads;
  g.group = num_heads / num_kv_heads;
  g.head_dim = head_dim;
  g.block_size = kv_cache.size(2);
  g.num_blocks = kv_cache.size(1);
  g.token_stride = num_kv_heads * head_dim;
  g.block_stride = g.block_size * g.token_stride;
  g.value_offset = g.num_blocks * g.block_stride;
  g.query_token_stride = query.stride(0);
  g.query_head_stride = query.stride(1);
  g.table_stride = block_table.stride(0);
  g.partition_size = partition_size;

  // Work items in (request, kv_head, partition) order; merge_items lists the first item of every
  // (request, kv_head) that has several partitions.
  const int32_t* lengths = seq_lens.data_ptr<int32_t>();
  std::vector<WorkItem> items;
  std::vector<int64_t> merge_items;
  items.reserve(num_decodes * num_kv_heads);
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
      if (num_partitions > 1) merge_items.push_back(static_cast<int64_t>(items.size()));
      for (int64_t partition = first_partition; partition <= last_partition; ++partition) {
        const int64_t begin = std::max(first, partition * partition_size);
        const int64_t end = std::min(seq_len, (partition + 1) * partition_size);
        items.push_back(WorkItem{static_cast<int32_t>(request), static_cast<int32_t>(kv_head),
                                 static_cast<int32_t>(begin), static_cast<int32_t>(end), num_partitions,
                                 static_cast<int32_t>(partition - first_partition)});
      }
    }
  }

  at::Tensor out = at::empty({num_decodes, num_heads, head_dim}, query.options());
  if (num_decodes == 0) return out;
  const auto query_type = query.scalar_type();
  const auto cache_type = kv_cache.scalar_type();
  TORCH_CHECK(query_type == at::kFloat || query_type == at::kBFloat16,
              "paged_decode_attention: query must be float32 or bfloat16");
  TORCH_CHECK(cache_type == at::kFloat || cache_type == at::kBFloat16,
              "paged_decode_attention: kv_cache must be float32 or bfloat16");
  if (query_type == at::kFloat && cache_type == at::kFloat)
    run_decode<float, float>(query, kv_cache, block_table, items, merge_items, g, scale, out);
  else if (query_type == at::kFloat)
    run_decode<float, c10::BFloat16>(query, kv_cache, block_table, items, merge_items, g, scale, out);
  else if (cache_type == at::kFloat)
    run_decode<c10::BFloat16, float>(query, kv_cache, block_table, items, merge_items, g, scale, out);
  else
    run_decode<c10::BFloat16, c10::BFloat16>(query, kv_cache, block_table, items, merge_items, g, scale, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("paged_decode_attention(Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, float scale, "
        "int? sliding_window, int partition_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
