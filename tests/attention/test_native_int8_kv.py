"""The native int8 KV cache kernels against their plain-PyTorch references (kv_cache_dtype="int8").

- `pagedserve::reshape_and_cache_int8` is bitwise kv_quantization.write_to_int8_kv_cache (values and scales), for
  float32 and bfloat16 inputs, contiguous and fused-QKV (strided) rows;
- `pagedserve::paged_decode_attention_int8` (int8 rows and their scales read in place) equals dequantize-then-attend
  (the whole cache dequantized into a float32 cache, then torch_paged's reference) to float32 rounding, on the
  unrolled AVX-512 path (head_dim 64/128), the vector path (head_dim a multiple of the lanes) and the scalar one,
  with a sliding window, several partitions;
- the cpu_native backend's whole forward with an int8 cache (native write and decodes, torch_paged's prefills over
  dequantized blocks) equals torch_paged's.
"""
from __future__ import annotations

import math

import pytest
import torch
from test_int8_kv_cache import SCHEDULE, dequantized_reference, paged_case

from pagedserve.attention.cpu_native import (
    CpuNativeAttentionBackend,
    paged_decode_attention,
    reshape_and_cache,
)
from pagedserve.attention.kv_quantization import (
    Int8KVPageLayout,
    allocate_int8_kv_cache,
    kv_cache_scales,
    write_to_int8_kv_cache,
)
from pagedserve.attention.torch_paged import TorchPagedAttentionBackend
from pagedserve.kernels import cpu_library


@pytest.fixture(scope="module", autouse=True)
def native_extension() -> None:
    cpu_library.load_native_extension()


def _zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_fused_qkv", [False, True])
def test_native_write_is_bitwise_the_reference(dtype: torch.dtype, is_fused_qkv: bool) -> None:
    num_tokens, num_kv_heads, head_dim, block_size = 37, 3, 24, 4
    generator = torch.Generator().manual_seed(5)
    magnitude = torch.rand(num_tokens, num_kv_heads, 1, generator=generator) * 4
    if is_fused_qkv:  # K and V as views into one [num_tokens, q + k + v] row, as the model's QKV projection gives
        fused = torch.randn(num_tokens, 5 * num_kv_heads * head_dim, generator=generator).to(dtype)
        width = num_kv_heads * head_dim
        key = fused[:, 3 * width:4 * width].view(num_tokens, num_kv_heads, head_dim)
        value = fused[:, 4 * width:].view(num_tokens, num_kv_heads, head_dim)
    else:
        key = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator) * magnitude).to(dtype)
        value = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator) * magnitude).to(dtype)
    key[3, 1].zero_()  # a zero row: scale 0
    slots = torch.randperm(20 * block_size, generator=generator)[:num_tokens] + block_size  # never block 0
    layout = Int8KVPageLayout(block_size, num_kv_heads, head_dim)
    native = allocate_int8_kv_cache(22, layout, _zeros)
    reference = allocate_int8_kv_cache(22, layout, _zeros)
    reshape_and_cache(key, value, native, slots)
    write_to_int8_kv_cache(key, value, reference, slots)
    assert torch.equal(native, reference)
    assert torch.equal(kv_cache_scales(native).view(torch.int32), kv_cache_scales(reference).view(torch.int32))
    assert kv_cache_scales(native).abs().sum() > 0 and native.abs().sum() > 0


def test_native_write_rejects_a_slot_past_the_cache() -> None:
    layout = Int8KVPageLayout(4, 1, 8)
    cache = allocate_int8_kv_cache(3, layout, _zeros)
    with pytest.raises(RuntimeError, match="out of range"):
        reshape_and_cache(torch.ones(1, 1, 8), torch.ones(1, 1, 8), cache, torch.tensor([12]))
    assert cache.abs().sum() == 0


def _decode_case(num_heads: int, num_kv_heads: int, head_dim: int, seed: int):
    schedule = [(37, 1), (5, 1), (70, 1), (0, 1), (300, 1)]
    return paged_case(schedule, num_heads, num_kv_heads, head_dim, 16, seed)


# AVX-512: head_dim 64/128 take the unrolled int8 path (GQA groups 2, 8, 1, and 5: a partial second sweep of
# heads), 12 and 40 the generic loop.
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim",
                         [(4, 2, 64), (8, 1, 128), (3, 3, 128), (10, 2, 64), (6, 3, 12), (2, 2, 40)])
@pytest.mark.parametrize("sliding_window", [None, 50])
@pytest.mark.parametrize("partition_size", [256, 16])
def test_decode_kernel_equals_dequantize_then_attend(num_heads: int, num_kv_heads: int, head_dim: int,
                                                     sliding_window: int | None, partition_size: int) -> None:
    int8_cache, _, query, key, value, metadata = _decode_case(num_heads, num_kv_heads, head_dim, seed=head_dim)
    scale = 1 / math.sqrt(head_dim)
    write_to_int8_kv_cache(key, value, int8_cache, metadata.slot_mapping)
    output = paged_decode_attention(query, int8_cache, metadata.block_table, metadata.seq_lens, scale,
                                    sliding_window, partition_size)
    reference = dequantized_reference(int8_cache, query, metadata, scale, sliding_window)
    torch.testing.assert_close(output, reference, rtol=2e-5, atol=2e-5)


def test_decode_kernel_bfloat16_query() -> None:
    int8_cache, _, query, key, value, metadata = _decode_case(4, 2, 64, seed=9)
    write_to_int8_kv_cache(key, value, int8_cache, metadata.slot_mapping)
    query = query.bfloat16()
    output = paged_decode_attention(query, int8_cache, metadata.block_table, metadata.seq_lens, 0.125)
    assert output.dtype == torch.bfloat16
    reference = dequantized_reference(int8_cache, query.float(), metadata, 0.125)
    torch.testing.assert_close(output.float(), reference, rtol=1e-2, atol=1e-2)


def test_decode_kernel_reads_the_scales() -> None:
    """Doubling one token's V scale moves the output by exactly that token's share: the kernel reads the scale
    of each row (not, say, the block's first)."""
    int8_cache, _, query, key, value, metadata = _decode_case(4, 2, 64, seed=11)
    write_to_int8_kv_cache(key, value, int8_cache, metadata.slot_mapping)
    before = paged_decode_attention(query, int8_cache, metadata.block_table, metadata.seq_lens, 0.125)
    block = int(metadata.block_table[0, 1])
    kv_cache_scales(int8_cache)[1, block, 3].mul_(2)  # request 0, position 19: its V rows, both heads
    after = paged_decode_attention(query, int8_cache, metadata.block_table, metadata.seq_lens, 0.125)
    reference = dequantized_reference(int8_cache, query, metadata, 0.125)
    torch.testing.assert_close(after, reference, rtol=2e-5, atol=2e-5)
    assert (after[0] - before[0]).abs().max() > 1e-3
    assert torch.equal(after[1:], before[1:])


def test_decode_kernel_rejects_an_int8_cache_without_scales() -> None:
    int8_cache, _, query, _, _, metadata = _decode_case(4, 2, 64, seed=1)
    with pytest.raises(RuntimeError, match="kv_scales"):
        torch.ops.pagedserve.paged_decode_attention(query, int8_cache, metadata.block_table, metadata.seq_lens, 0.1,
                                                    None, 256)


@pytest.mark.parametrize("sliding_window", [None, 9])
def test_cpu_native_backend_int8_equals_torch_paged(sliding_window: int | None) -> None:
    """A mixed step (decodes, a prefill over a cached prefix, a fresh prefill): write, decodes and prefills."""
    native_cache, _, query, key, value, metadata = paged_case(SCHEDULE, 4, 2, 64, 4, seed=7)
    torch_cache = allocate_int8_kv_cache(native_cache.shape[1], Int8KVPageLayout(4, 2, 64), _zeros)
    torch_cache.copy_(native_cache)
    kv_cache_scales(torch_cache).copy_(kv_cache_scales(native_cache))
    scale = 0.125
    native = CpuNativeAttentionBackend().forward(query, key, value, native_cache, metadata, scale, sliding_window)
    portable = TorchPagedAttentionBackend().forward(query, key, value, torch_cache, metadata, scale, sliding_window)
    assert torch.equal(native_cache, torch_cache)
    torch.testing.assert_close(native, portable, rtol=2e-5, atol=2e-5)
    # The decode-only fast path (no prefills) as well.
    decodes = paged_case([(37, 1), (5, 1), (70, 1)], 4, 2, 64, 4, seed=8)
    native_cache, _, query, key, value, metadata = decodes
    native = CpuNativeAttentionBackend().forward(query, key, value, native_cache, metadata, scale, sliding_window)
    reference = dequantized_reference(native_cache, query, metadata, scale, sliding_window)
    torch.testing.assert_close(native, reference, rtol=2e-5, atol=2e-5)
