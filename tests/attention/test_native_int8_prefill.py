"""The native prefill kernel over int8 KV pages (`pagedserve::paged_prefill_attention_int8`) against its references.

- Kernel level, on each product unit this CPU has (AMX, AVX512-BF16 dot products, float32 FMA): the int8 op, which
  reads the int8 rows and their scales in place through the block table, is bitwise the prefill kernel run over the
  same cache dequantized to the query's dtype (kv_quantization.dequantize_kv_cache: the values its pack phase
  dequantizes are those exactly). Fresh prompts and chunks behind cached prefixes (chunked prefill, prefix-cache
  hits), GQA 1/3/4, head_dim 64/128, block sizes 8/16/32, sliding windows.
- Backend level: cpu_native's forward on an int8 cache (decodes, fresh prompts, chunks behind cached prefixes,
  padding rows; the prefills on the kernel, counted) equals torch_paged's gather + dequantize + SDPA path, the plain
  reference, within the tolerances the other int8 and prefill-kernel tests use; the K/V writes are bitwise equal.
- End to end: test_prefill_attention.py's engine test runs with kv_cache_dtype int8 too (slow).
- Errors name the argument; the op has a fake implementation.
"""
from __future__ import annotations


import pytest
import torch

from attention.test_cpu_native import _step
from pagedserve.attention import cpu_native
from pagedserve.attention.cpu_native import CpuNativeAttentionBackend, paged_prefill_attention
from pagedserve.attention.kv_quantization import (
    Int8KVPageLayout,
    allocate_int8_kv_cache,
    dequantize_kv_cache,
    kv_cache_scales,
    write_to_int8_kv_cache,
)
from pagedserve.attention.torch_paged import TorchPagedAttentionBackend
from pagedserve.kernels import cpu_library

BF16 = torch.bfloat16


@pytest.fixture(scope="module", autouse=True)
def prefill_kernel() -> None:
    if not cpu_library.is_native_extension_available():
        pytest.skip("no native build here (PAGEDSERVE_CPU_ISA=none or no compiler): int8 prefills take torch_paged")
    if not cpu_native.is_prefill_attention_available():
        pytest.skip("the prefill kernel is not built at this ISA level (it needs AMX-BF16 or AVX512-BF16; lower levels, "
                    "by the CPU or PAGEDSERVE_CPU_ISA, take torch_paged's path)")


@pytest.fixture(params=["amx", "avx512_bf16", "avx512_fp32"])
def products(request) -> str:
    if request.param not in cpu_native.prefill_attention_products():
        pytest.skip(f"no {request.param} here (available: {cpu_native.prefill_attention_products()})")
    return request.param


def _zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def _quantized(float_cache: torch.Tensor) -> torch.Tensor:
    """int8 pages holding `float_cache` [2, num_blocks, block_size, H, D] quantized (every slot, stale ones too),
    with per-token magnitudes that vary, so each row's own scale matters."""
    _, num_blocks, block_size, num_kv_heads, head_dim = float_cache.shape
    cache = allocate_int8_kv_cache(num_blocks, Int8KVPageLayout(block_size, num_kv_heads, head_dim), _zeros)
    magnitude = torch.rand(2, num_blocks * block_size, num_kv_heads, 1, generator=torch.Generator().manual_seed(1))
    rows = float_cache.float().reshape(2, -1, num_kv_heads, head_dim) * (magnitude * 3 + 0.3)
    write_to_int8_kv_cache(rows[0], rows[1], cache, torch.arange(num_blocks * block_size))
    return cache


def _int8_prefill_inputs(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, seed, dtype):
    """A step of prefills over int8 pages that already hold the new tokens' K/V (as after the step's write)."""
    query, key, value, float_cache, metadata = _step(query_lens, seq_lens, num_heads, num_kv_heads, head_dim,
                                                     block_size, dtype, seed=seed)
    cache = _quantized(float_cache)
    num_tokens = metadata.num_actual_tokens
    write_to_int8_kv_cache(key[:num_tokens], value[:num_tokens], cache, metadata.slot_mapping[:num_tokens])
    return query, cache, metadata


def _dtype_of(products: str) -> torch.dtype:
    return torch.float32 if products == "avx512_fp32" else BF16


def _check_bitwise(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, products,
                   sliding_window=None, seed=0) -> None:
    dtype = _dtype_of(products)
    query, cache, metadata = _int8_prefill_inputs(query_lens, seq_lens, num_heads, num_kv_heads, head_dim,
                                                  block_size, seed, dtype)
    args = (metadata.block_table, metadata.seq_lens, metadata.query_start_loc, head_dim ** -0.5, sliding_window,
            products)
    actual = paged_prefill_attention(query, cache, *args)
    expected = paged_prefill_attention(query, dequantize_kv_cache(cache, dtype), *args)
    assert actual.dtype == dtype and actual.shape == query.shape
    assert torch.equal(actual, expected)
    assert actual.abs().sum() > 0


# Fresh prompts at the tile (16) and chunk (128) edges, and chunks behind cached prefixes.
FRESH = [1, 15, 16, 17, 128, 129, 300]
CHUNKED_QUERY_LENS, CHUNKED_SEQ_LENS = [37, 1, 64, 130], [100, 200, 600, 390]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2)], ids=["gqa1", "gqa3", "gqa4"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 32])  # 16: the tests below
def test_int8_kernel_is_the_kernel_over_the_dequantized_cache(products, num_heads, num_kv_heads, head_dim,
                                                             block_size) -> None:
    _check_bitwise(FRESH + CHUNKED_QUERY_LENS, FRESH + CHUNKED_SEQ_LENS, num_heads, num_kv_heads, head_dim,
                   block_size, products, seed=head_dim + block_size)


@pytest.mark.parametrize("sliding_window", [1, 7, 37, 300])
def test_int8_kernel_sliding_window(products, sliding_window: int) -> None:
    _check_bitwise(FRESH + CHUNKED_QUERY_LENS, FRESH + CHUNKED_SEQ_LENS, 9, 3, 64, 16, products, sliding_window,
                   seed=sliding_window)


def test_int8_kernel_reads_each_rows_scale(products) -> None:
    """Doubling one context token's K and V scales changes that request's rows and no other request's."""
    dtype = _dtype_of(products)
    query, cache, metadata = _int8_prefill_inputs([20, 30], [60, 30], 4, 2, 64, 16, 4, dtype)
    args = (metadata.block_table, metadata.seq_lens, metadata.query_start_loc, 0.125, None, products)
    before = paged_prefill_attention(query, cache, *args)
    block = int(metadata.block_table[0, 1])
    kv_cache_scales(cache)[:, block, 5].mul_(2)  # request 0, position 21: seen by its rows (positions 40-59)
    after = paged_prefill_attention(query, cache, *args)
    assert torch.equal(after, paged_prefill_attention(query, dequantize_kv_cache(cache, dtype), *args))
    assert (after[:20] - before[:20]).abs().max() > 1e-3
    assert torch.equal(after[20:], before[20:])


@pytest.fixture
def kernel_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = cpu_native.paged_prefill_attention
    monkeypatch.setattr(cpu_native, "paged_prefill_attention", lambda *args: calls.append(1) or real(*args))
    return calls


def _copy_of(cache: torch.Tensor) -> torch.Tensor:
    copy = allocate_int8_kv_cache(cache.shape[1], Int8KVPageLayout(*cache.shape[2:]), _zeros)
    copy.copy_(cache)
    kv_cache_scales(copy).copy_(kv_cache_scales(cache))
    return copy


@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("sliding_window", [None, 37])
@pytest.mark.parametrize("block_size", [16, 32])
def test_backend_int8_prefills_match_the_gather_sdpa_reference(kernel_calls, dtype, sliding_window,
                                                               block_size) -> None:
    """Decodes first, then fresh prompts and chunks behind cached prefixes, then padding rows."""
    query_lens = [1, 1, 9, 20, 150, 1, 64]
    seq_lens = [40, 300, 9, 70, 150, 33, 600]
    query, key, value, float_cache, metadata = _step(query_lens, seq_lens, 9, 3, 64, block_size, dtype,
                                                     num_padding_tokens=3)
    native_cache = _quantized(float_cache)
    torch_cache = _copy_of(native_cache)
    expected = TorchPagedAttentionBackend().forward(query, key, value, torch_cache, metadata, 0.125, sliding_window)
    actual = CpuNativeAttentionBackend().forward(query, key, value, native_cache, metadata, 0.125, sliding_window)
    assert kernel_calls == [1]
    assert torch.equal(native_cache, torch_cache)
    assert torch.equal(kv_cache_scales(native_cache).view(torch.int32), kv_cache_scales(torch_cache).view(torch.int32))
    # Prefill rows: bf16, the kernel's P in bf16 and its output rounding (the prefill kernel's own tolerance);
    # float32, fp32 sums. Decode rows (the int8 decode kernel): in bf16 the reference also rounds the dequantized K/V
    # to bf16 before SDPA, which the kernel (int8 rows times the scale in float32) does not.
    num_decodes, end = metadata.num_decodes, metadata.num_actual_tokens
    tolerance = 1e-2 if dtype == BF16 else 2e-5
    torch.testing.assert_close(actual[num_decodes:end].float(), expected[num_decodes:end].float(), atol=tolerance,
                               rtol=tolerance)
    decode_tolerance = 4e-2 if dtype == BF16 else 2e-5
    torch.testing.assert_close(actual[:num_decodes].float(), expected[:num_decodes].float(), atol=decode_tolerance,
                               rtol=decode_tolerance)
    assert torch.all(actual[end:] == 0)


def test_int8_op_bad_inputs_raise_clear_errors() -> None:
    query, cache, metadata = _int8_prefill_inputs([20, 33], [20, 40], 4, 2, 64, 16, 0, BF16)
    table, lens, starts = metadata.block_table, metadata.seq_lens, metadata.query_start_loc
    op = torch.ops.pagedserve.paged_prefill_attention_int8
    scales = kv_cache_scales(cache)
    with pytest.raises(RuntimeError, match="paged_prefill_attention_int8: kv_scales must be a float32"):
        op(query, cache, scales[:, :, :, :1], table, lens, starts, 0.1, None)
    with pytest.raises(RuntimeError, match="paged_prefill_attention_int8: kv_cache must be an int8"):
        op(query, dequantize_kv_cache(cache, BF16), scales, table, lens, starts, 0.1, None)
    with pytest.raises(RuntimeError, match="paged_prefill_attention_int8: head_dim=32 must be a multiple of 64"):
        op(query[..., :32].contiguous(), cache[..., :32], scales, table, lens, starts, 0.1, None)
    bad_table = table.clone()
    bad_table[1, 1] = cache.shape[1] + 5
    with pytest.raises(RuntimeError, match=f"block id {cache.shape[1] + 5} is outside the cache"):
        op(query, cache, scales, bad_table, lens, starts, 0.1, None)


def test_int8_op_registration_and_fake_impl() -> None:
    query, cache, metadata = _int8_prefill_inputs([20, 33], [20, 40], 4, 2, 64, 16, 0, BF16)
    args = (query, cache, kv_cache_scales(cache), metadata.block_table, metadata.seq_lens, metadata.query_start_loc,
            0.125, None)
    torch.library.opcheck(torch.ops.pagedserve.paged_prefill_attention_int8.default, args)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = torch.ops.pagedserve.paged_prefill_attention_int8(
            *(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert fake.shape == query.shape and fake.dtype == BF16
