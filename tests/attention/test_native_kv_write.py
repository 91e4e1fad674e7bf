"""The native K/V cache write (`pagedserve::reshape_and_cache`) against torch_paged.write_to_kv_cache.

Op level, bitwise (the caches compared as integer bits, so -0.0 / +0.0 and rounding differences show):
float32 -> float32, bfloat16 -> bfloat16, float32 -> bfloat16 (round to nearest even, ties both ways,
subnormals, overflow to inf) and bfloat16 -> float32, token counts 1..300, block sizes 16 and 32, slots
scattered over shuffled blocks, contiguous / fused-QKV / head-strided / element-strided inputs, the
multi-threaded path, skipped negative slots and a rejected out-of-range slot. Backend level: cpu_native's
whole forward (native write + native decodes) against torch_paged's, and the hook really being the native one.
"""
from __future__ import annotations

import random

import pytest
import torch

from paged_inputs import build_attention_metadata
from pagedserve.kernels import cpu_library as cpu_native_extension
from pagedserve.attention import torch_paged
from pagedserve.attention.cpu_native import CpuNativeAttentionBackend, reshape_and_cache
from pagedserve.attention.torch_paged import TorchPagedAttentionBackend, write_to_kv_cache

# (input dtype, cache dtype)
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
               (torch.bfloat16, torch.float32)]
PAIR_IDS = ["f32-f32", "bf16-bf16", "f32-bf16", "bf16-f32"]
NUM_KV_HEADS, HEAD_DIM = 3, 64


@pytest.fixture(scope="module", autouse=True)
def native_extension() -> None:
    cpu_native_extension.load_native_extension()


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits (bitwise comparison: torch.equal on floats treats -0.0 == 0.0)."""
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def _stale_cache(num_blocks: int, block_size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype)


def _inputs(num_tokens: int, dtype: torch.dtype, layout: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [num_tokens, NUM_KV_HEADS, HEAD_DIM] as the given kind of view."""
    generator = torch.Generator().manual_seed(seed)
    width = NUM_KV_HEADS * HEAD_DIM
    if layout == "contiguous":
        key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
        value = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    elif layout == "fused_qkv":
        # What the Attention layer passes: views into one [num_tokens, q + k + v] projection output.
        fused = torch.randn(num_tokens, 3 * width + width, generator=generator).to(dtype)
        key = fused[:, 3 * width - width:3 * width].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
        value = fused[:, 3 * width:].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
        assert not key.is_contiguous() and key.stride(1) == HEAD_DIM
    elif layout == "head_strided":  # a token's heads are not back to back (the per-head copy path)
        wide = torch.randn(2, num_tokens, NUM_KV_HEADS, 2 * HEAD_DIM, generator=generator).to(dtype)
        key, value = wide[0, :, :, :HEAD_DIM], wide[1, :, :, HEAD_DIM:]
        assert key.stride(1) == 2 * HEAD_DIM
    else:  # element_strided: head_dim itself strided (the scalar path)
        wide = torch.randn(2, num_tokens, NUM_KV_HEADS, HEAD_DIM, 2, generator=generator).to(dtype)
        key, value = wide[0, ..., 0], wide[1, ..., 1]
        assert key.stride(2) == 2
    return key, value


def _check_write(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
                 reference_slots: torch.Tensor | None = None, reference_rows: torch.Tensor | None = None) -> None:
    """Native write into `cache` == write_to_kv_cache into a clone of it, bit for bit (the whole cache)."""
    expected = cache.clone()
    if reference_rows is None:
        write_to_kv_cache(key, value, expected, slots)
    else:
        write_to_kv_cache(key[reference_rows], value[reference_rows], expected, reference_slots)
    reshape_and_cache(key, value, cache, slots)
    assert torch.equal(_bits(cache), _bits(expected))


@pytest.mark.parametrize("input_dtype,cache_dtype", DTYPE_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("layout", ["contiguous", "fused_qkv", "head_strided", "element_strided"])
def test_equals_write_to_kv_cache_for_1_to_300_tokens(input_dtype, cache_dtype, block_size, layout) -> None:
    num_blocks = 320 // block_size + 4
    rng = random.Random(block_size)
    key, value = _inputs(300, input_dtype, layout, seed=block_size)
    cache = _stale_cache(num_blocks, block_size, cache_dtype, seed=1)
    for num_tokens in range(1, 301):
        # Distinct slots anywhere in the cache (shuffled blocks, any offset), new each time.
        slots = torch.tensor(rng.sample(range(block_size, num_blocks * block_size), num_tokens), dtype=torch.int64)
        _check_write(key[:num_tokens], value[:num_tokens], cache, slots)


def test_rounding_to_bfloat16_matches_tensor_to() -> None:
    """Ties to even (both parities), values just above/below a tie, subnormals, overflow to inf, signed zeros,
    infinities: the bits Tensor.to(torch.bfloat16) produces, in the vector lanes and the scalar tail alike."""
    patterns = [0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x3F818001, 0x00000001, 0x00008000, 0x00018000,
                0x007FFFFF, 0x80408000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x00000000, 0x80000000, 0x7F800000,
                0xFF800000, 0x3DCCCCCD, 0xBDCCCCCD, 0x4B7FFFFF]
    generator = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (4096,), generator=generator, dtype=torch.int64)
    bits = torch.tensor(patterns, dtype=torch.int64)
    bits = torch.cat([bits, random_bits]).to(torch.int32)  # wraps to the same 32-bit patterns
    floats = bits.view(torch.float32)
    floats = torch.where(torch.isnan(floats), torch.ones_like(floats), floats)  # NaNs: checked below
    for head_dim in (HEAD_DIM, 24):  # 24: one vector of 16 lanes then an 8-lane scalar tail
        rows = floats[:floats.numel() // (NUM_KV_HEADS * head_dim) * NUM_KV_HEADS * head_dim]
        key = rows.view(-1, NUM_KV_HEADS, head_dim)
        value = key.flip(0)
        cache = torch.zeros(2, key.shape[0], 1, NUM_KV_HEADS, head_dim, dtype=torch.bfloat16)
        slots = torch.arange(key.shape[0], dtype=torch.int64)
        reshape_and_cache(key, value, cache, slots)
        assert torch.equal(_bits(cache[0, :, 0]), _bits(key.to(torch.bfloat16)))
        assert torch.equal(_bits(cache[1, :, 0]), _bits(value.to(torch.bfloat16)))
    nan_key = torch.full((2, NUM_KV_HEADS, 24), float("nan"))
    cache = torch.zeros(2, 2, 1, NUM_KV_HEADS, 24, dtype=torch.bfloat16)
    reshape_and_cache(nan_key, nan_key, cache, torch.tensor([0, 1]))
    assert torch.isnan(cache.float()).all()


@pytest.mark.parametrize("input_dtype,cache_dtype", DTYPE_PAIRS, ids=PAIR_IDS)
def test_many_tokens_threaded_and_thread_count_invariant(input_dtype, cache_dtype) -> None:
    """A prefill-sized write (split over the threads) equals the reference with 1 and 2 threads."""
    num_tokens, block_size = 5000, 16
    num_blocks = num_tokens // block_size + 10
    key, value = _inputs(num_tokens, input_dtype, "fused_qkv", seed=3)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(2))[:num_tokens]
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            _check_write(key, value, _stale_cache(num_blocks, block_size, cache_dtype, seed=4), slots)
    finally:
        torch.set_num_threads(threads)


def test_negative_slots_are_skipped() -> None:
    key, value = _inputs(40, torch.float32, "fused_qkv", seed=5)
    slots = torch.randperm(20 * 16, generator=torch.Generator().manual_seed(5))[:40]
    padding = torch.zeros(40, dtype=torch.bool)
    padding[[0, 7, 8, 39]] = True
    slots[padding] = -1
    cache = _stale_cache(20, 16, torch.bfloat16, seed=6)
    _check_write(key, value, cache, slots, reference_slots=slots[~padding], reference_rows=~padding)


def test_out_of_range_slot_raises_before_writing() -> None:
    key, value = _inputs(10, torch.float32, "contiguous", seed=7)
    cache = _stale_cache(4, 16, torch.float32, seed=8)
    before = cache.clone()
    slots = torch.arange(10, dtype=torch.int64)
    slots[9] = 4 * 16
    with pytest.raises(RuntimeError, match="out of range"):
        reshape_and_cache(key, value, cache, slots)
    assert torch.equal(cache, before)
    with pytest.raises(RuntimeError, match="int64"):
        reshape_and_cache(key, value, cache, slots.to(torch.int32))
    with pytest.raises(RuntimeError, match="must match"):
        reshape_and_cache(key[:, :2], value[:, :2], cache, slots)


def test_op_registration_and_fake_impl() -> None:
    """Schema (mutates kv_cache), fake impl and dispatch agree: what torch.compile needs for an opaque op."""
    key, value = _inputs(20, torch.float32, "fused_qkv", seed=9)
    cache = _stale_cache(8, 16, torch.bfloat16, seed=10)
    slots = torch.randperm(8 * 16, generator=torch.Generator().manual_seed(9))[:20]
    torch.library.opcheck(torch.ops.pagedserve.reshape_and_cache.default, (key, value, cache, slots))


def _mixed_step(input_dtype: torch.dtype, cache_dtype: torch.dtype, block_size: int, num_padding_tokens: int,
                fused: bool):
    """Decodes first, then a fresh prompt and a prefill chunk behind a cached prefix, then padding rows."""
    num_heads = 9
    num_new = [1, 1, 1, 1, 9, 40, 20]
    num_computed = [39, 299, 0, 511, 0, 0, 70]
    rng = random.Random(block_size)
    num_blocks = sum(-(-(n + c) // block_size) for n, c in zip(num_new, num_computed)) + 4
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = []
    for new, computed in zip(num_new, num_computed):
        count = -(-(new + computed) // block_size)
        tables.append(free[:count])
        free = free[count:]
    metadata, _ = build_attention_metadata(num_new, num_computed, tables, block_size)
    total = metadata.num_actual_tokens + num_padding_tokens
    generator = torch.Generator().manual_seed(block_size)
    q_width, kv_width = num_heads * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    if fused:
        qkv = torch.randn(total, q_width + 2 * kv_width, generator=generator).to(input_dtype)
        query, key, value = qkv.split([q_width, kv_width, kv_width], dim=1)
    else:
        query = torch.randn(total, q_width, generator=generator).to(input_dtype)
        key = torch.randn(total, kv_width, generator=generator).to(input_dtype)
        value = torch.randn(total, kv_width, generator=generator).to(input_dtype)
    if num_padding_tokens:
        metadata.slot_mapping = torch.cat([metadata.slot_mapping, torch.zeros(num_padding_tokens, dtype=torch.int64)])
    query, key, value = (part.view(total, -1, HEAD_DIM) for part in (query, key, value))
    return query, key, value, _stale_cache(num_blocks, block_size, cache_dtype, seed=block_size), metadata


@pytest.mark.parametrize("input_dtype,cache_dtype", DTYPE_PAIRS[:3], ids=PAIR_IDS[:3])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("fused", [True, False], ids=["fused_qkv", "separate"])
def test_backend_forward_equals_torch_paged(input_dtype, cache_dtype, block_size, fused) -> None:
    """cpu_native's forward (native write + native decodes) against torch_paged's: the caches bit for bit
    (padding rows never written), the outputs to the attention tolerance."""
    query, key, value, cache, metadata = _mixed_step(input_dtype, cache_dtype, block_size, num_padding_tokens=3,
                                                     fused=fused)
    expected_cache = cache.clone()
    scale = HEAD_DIM ** -0.5
    expected = TorchPagedAttentionBackend().forward(query, key, value, expected_cache, metadata, scale)
    actual = CpuNativeAttentionBackend().forward(query, key, value, cache, metadata, scale)
    assert torch.equal(_bits(cache), _bits(expected_cache))
    tolerance = dict(atol=1e-5, rtol=1e-5) if input_dtype == cache_dtype == torch.float32 else dict(atol=2e-2,
                                                                                                    rtol=2e-2)
    torch.testing.assert_close(actual.float(), expected.float(), **tolerance)
    assert torch.all(actual[-3:] == 0)


def test_backend_uses_the_native_write_and_falls_back_for_other_dtypes(monkeypatch) -> None:
    """The hook is really overridden (the reference is never called for float32/bfloat16), and a dtype the
    kernel does not take (float16) still goes through write_to_kv_cache."""
    calls = []
    reference = torch_paged.write_to_kv_cache

    def counting_reference(*args) -> None:
        calls.append(args[0].dtype)
        reference(*args)

    monkeypatch.setattr(torch_paged, "write_to_kv_cache", counting_reference)
    query, key, value, cache, metadata = _mixed_step(torch.bfloat16, torch.bfloat16, 16, 0, fused=True)
    backend = CpuNativeAttentionBackend()
    backend.forward(query, key, value, cache, metadata, HEAD_DIM ** -0.5)
    assert calls == []
    TorchPagedAttentionBackend().forward(query, key, value, cache.clone(), metadata, HEAD_DIM ** -0.5)
    assert calls == [torch.bfloat16]
    half_key, half_value = key.half(), value.half()
    half_cache = cache.half()
    expected = half_cache.clone()
    reference(half_key, half_value, expected, metadata.slot_mapping)
    backend._write_kv(half_key, half_value, half_cache, metadata.slot_mapping)
    assert calls == [torch.bfloat16, torch.float16]
    assert torch.equal(_bits(half_cache), _bits(expected))
