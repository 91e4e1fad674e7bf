"""The prefill attention kernel (cpu_native's prefills) against dense float64 attention and torch_paged.

Kernel level, on each product unit this CPU has (AMX tiles and AVX512-BF16 dot products for bfloat16, FMA for
float32): fresh prompts and chunks behind cached prefixes, lengths at the tile (16) and chunk (128) edges, GQA ratios
1/3/4, head_dim 64/128/256, block sizes 16/32, sliding windows; a request's rows bitwise the same alone, inside a
batch and at 1 or 2 threads; strided (fused-QKV) queries; errors. Backend level: the kernel runs for bfloat16 and
float32 (counted) and not for other head dims, mixed decode + prefill + padding steps agree with torch_paged. End to
end: a bfloat16 engine's logprobs with chunked prefill and prefix caching as close to a float32 run as the
torch_paged backend's; a float32 engine's greedy tokens the same as torch_paged's.
"""
from __future__ import annotations

import random

import pytest
import torch

from attention.test_cpu_native import _step
from pagedserve.attention import cpu_native
from pagedserve.kernels import cpu_library as cpu_native_extension
from pagedserve.attention.cpu_native import CpuNativeAttentionBackend, paged_prefill_attention
from pagedserve.attention.torch_paged import TorchPagedAttentionBackend

BF16 = torch.bfloat16


@pytest.fixture(scope="module", autouse=True)
def prefill_kernel() -> None:
    cpu_native_extension.load_native_extension()
    if not cpu_native.is_prefill_attention_available():
        pytest.skip("this CPU has neither AMX-BF16 nor AVX512-BF16: the prefill kernel is not used")


@pytest.fixture(params=["amx", "avx512_bf16", "avx512_fp32"])
def products(request) -> str:
    """Each product unit of the kernel, where this build and process can run it."""
    if request.param not in cpu_native.prefill_attention_products():
        pytest.skip(f"no {request.param} here (available: {cpu_native.prefill_attention_products()})")
    return request.param


def _dtype_of(products: str) -> torch.dtype:
    """The inputs' dtype a unit takes ('auto': bfloat16)."""
    return torch.float32 if products == "avx512_fp32" else BF16


def _prefill_inputs(query_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                    block_size: int, seed: int = 0, dtype: torch.dtype = BF16):
    """A step of prefills only: their K/V already written into the cache, and the kernel's int32 inputs."""
    query, key, value, kv_cache, metadata = _step(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size,
                                                  dtype, seed=seed)
    num_tokens = metadata.num_actual_tokens
    kv_cache.view(2, -1, num_kv_heads, head_dim)[0, metadata.slot_mapping[:num_tokens]] = key[:num_tokens]
    kv_cache.view(2, -1, num_kv_heads, head_dim)[1, metadata.slot_mapping[:num_tokens]] = value[:num_tokens]
    return query, kv_cache, metadata


def _float64_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_row: torch.Tensor, seq_len: int,
                       scale: float, sliding_window: int | None) -> torch.Tensor:
    """One request's rows by the definition: dense float64 causal (windowed) attention over its context."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    q_len, num_heads, _ = query.shape
    positions = torch.arange(seq_len)
    slots = block_row.long()[positions // block_size] * block_size + positions % block_size
    flat = kv_cache.double().view(2, -1, num_kv_heads, head_dim)
    group = num_heads // num_kv_heads
    keys = flat[0, slots].repeat_interleave(group, dim=1)  # [seq_len, H, D]
    values = flat[1, slots].repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys) * scale
    query_positions = torch.arange(seq_len - q_len, seq_len)[:, None]
    hidden = positions[None, :] > query_positions
    if sliding_window is not None:
        hidden |= positions[None, :] <= query_positions - sliding_window
    scores = scores.masked_fill(hidden[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def _check_against_float64(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size,
                           sliding_window=None, seed=0, products="auto") -> None:
    dtype = _dtype_of(products)
    query, kv_cache, metadata = _prefill_inputs(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size,
                                                seed, dtype)
    scale = head_dim ** -0.5
    actual = paged_prefill_attention(query, kv_cache, metadata.block_table, metadata.seq_lens,
                                     metadata.query_start_loc, scale, sliding_window, products)
    assert actual.shape == query.shape and actual.dtype == dtype
    # bf16: output (2^-9 relative) and P rounded to bf16 before the second product; float32: fp32 sums only.
    tolerance = 1e-2 if dtype == BF16 else 2e-5
    starts = metadata.query_start_loc_cpu
    for index, seq_len in enumerate(seq_lens):
        rows = slice(starts[index], starts[index + 1])
        expected = _float64_attention(query[rows], kv_cache, metadata.block_table[index], seq_len, scale,
                                      sliding_window)
        torch.testing.assert_close(actual[rows].double(), expected, atol=tolerance, rtol=tolerance,
                                   msg=lambda m: f"request {index} (q_len {query_lens[index]}, seq_len {seq_len}): {m}")


# Fresh prompts at the tile (16) and chunk (128) edges, and chunks behind cached prefixes (1 token, partial tiles,
# a prefix crossing chunks).
FRESH = [1, 15, 16, 17, 127, 128, 129, 300]
CHUNKED_QUERY_LENS, CHUNKED_SEQ_LENS = [37, 1, 64, 130], [100, 200, 600, 390]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2)], ids=["gqa1", "gqa3", "gqa4"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
def test_kernel_matches_float64_attention(products, num_heads, num_kv_heads, head_dim, block_size) -> None:
    _check_against_float64(FRESH + CHUNKED_QUERY_LENS, FRESH + CHUNKED_SEQ_LENS, num_heads, num_kv_heads, head_dim,
                           block_size, seed=head_dim + block_size, products=products)


def test_last_chunk_cut_at_the_tile_end(products) -> None:
    """A tile's last chunk ends at the tile's last position rounded up to 32 keys (the products and softmax past it
    are skipped): prompts ending at and around each 32-key edge inside a chunk, and chunks behind cached prefixes."""
    lengths = [31, 32, 33, 63, 64, 65, 95, 96, 97, 159, 160, 161, 223, 224, 225]
    _check_against_float64(lengths, lengths, 9, 3, 64, 16, seed=5, products=products)
    _check_against_float64([1, 17, 40, 100], [100, 161, 230, 383], 9, 3, 64, 16, seed=6, products=products)


@pytest.mark.parametrize("sliding_window", [1, 7, 37, 128, 300])
def test_sliding_window(products, sliding_window: int) -> None:
    _check_against_float64(FRESH + CHUNKED_QUERY_LENS, FRESH + CHUNKED_SEQ_LENS, 9, 3, 64, 16, sliding_window,
                           seed=sliding_window, products=products)


def test_rows_are_the_same_in_any_batch_and_thread_count(products) -> None:
    """A request's rows have the same bits alone, at any position of a batch, and at 1 or 2 threads."""
    rng = random.Random(3)
    query_lens = [rng.randint(1, 300) for _ in range(8)]
    seq_lens = [q + rng.choice([0, 0, 5, 140]) for q in query_lens]
    query, kv_cache, metadata = _prefill_inputs(query_lens, seq_lens, 9, 3, 64, 16, seed=3, dtype=_dtype_of(products))
    starts = metadata.query_start_loc_cpu

    def run(members: list[int]) -> list[torch.Tensor]:
        rows = [torch.arange(starts[m], starts[m + 1]) for m in members]
        local_starts = [0]
        for member in members:
            local_starts.append(local_starts[-1] + query_lens[member])
        order = torch.tensor(members)
        out = paged_prefill_attention(query[torch.cat(rows)], kv_cache, metadata.block_table[order],
                                      metadata.seq_lens[order], torch.tensor(local_starts, dtype=torch.int32), 0.125,
                                      None, products)
        return [out[local_starts[i]:local_starts[i + 1]] for i in range(len(members))]

    alone = [run([m])[0] for m in range(len(query_lens))]
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            members = list(range(len(query_lens)))
            rng.shuffle(members)
            for member, rows in zip(members, run(members)):
                assert torch.equal(rows, alone[member]), f"request {member} at {num_threads} threads"
    finally:
        torch.set_num_threads(threads)


def test_strided_query_from_fused_qkv(products) -> None:
    dtype = _dtype_of(products)
    query, kv_cache, metadata = _prefill_inputs([40, 70], [40, 200], 6, 2, 64, 16, dtype=dtype)
    fused = torch.cat([query.flatten(1), torch.zeros(query.shape[0], 256, dtype=dtype)], dim=1)
    query_view = fused[:, :6 * 64].view(-1, 6, 64)
    assert not query_view.is_contiguous()
    args = (kv_cache, metadata.block_table, metadata.seq_lens, metadata.query_start_loc, 0.125, None, products)
    assert torch.equal(paged_prefill_attention(query_view, *args), paged_prefill_attention(query, *args))


def test_auto_takes_the_first_available_unit_of_the_dtype() -> None:
    available = cpu_native.prefill_attention_products()
    assert available and set(available) <= {"amx", "avx512_bf16", "avx512_fp32"} and available[-1] == "avx512_fp32"
    for dtype, unit in ((BF16, available[0]), (torch.float32, "avx512_fp32")):
        query, kv_cache, metadata = _prefill_inputs([40, 70], [40, 200], 6, 2, 64, 16, dtype=dtype)
        args = (query, kv_cache, metadata.block_table, metadata.seq_lens, metadata.query_start_loc, 0.125, None)
        assert torch.equal(paged_prefill_attention(*args), paged_prefill_attention(*args, unit))


def test_units_agree_where_both_run() -> None:
    """AMX and the dot products round their fp32 sums differently, nothing more."""
    if cpu_native.prefill_attention_products() != ["amx", "avx512_bf16"]:
        pytest.skip("needs both AMX and AVX512-BF16")
    query, kv_cache, metadata = _prefill_inputs(FRESH, FRESH, 9, 3, 64, 16, seed=11)
    args = (query, kv_cache, metadata.block_table, metadata.seq_lens, metadata.query_start_loc, 0.125, None)
    torch.testing.assert_close(paged_prefill_attention(*args, "amx").float(),
                               paged_prefill_attention(*args, "avx512_bf16").float(), atol=1e-2, rtol=1e-2)


def test_bad_inputs_raise_clear_errors() -> None:
    query, kv_cache, metadata = _prefill_inputs([20, 33], [20, 40], 4, 2, 64, 16)
    table, lens, starts = metadata.block_table, metadata.seq_lens, metadata.query_start_loc
    with pytest.raises(RuntimeError, match="bfloat16 or float32 with contiguous heads expected"):
        paged_prefill_attention(query.half(), kv_cache, table, lens, starts, 0.1)
    with pytest.raises(RuntimeError, match="head_dim=32 must be a multiple of 64"):
        paged_prefill_attention(query[..., :32].contiguous(), kv_cache[..., :32].contiguous(), table, lens, starts, 0.1)
    with pytest.raises(RuntimeError, match="q_len <= seq_len"):
        paged_prefill_attention(query, kv_cache, table, torch.tensor([20, 30], dtype=torch.int32), starts, 0.1)
    with pytest.raises(RuntimeError, match="int32"):
        paged_prefill_attention(query, kv_cache, table.long(), lens, starts, 0.1)
    with pytest.raises(RuntimeError, match="sliding_window=0 must be >= 1"):
        paged_prefill_attention(query, kv_cache, table, lens, starts, 0.1, 0)
    with pytest.raises(RuntimeError,
                       match="products must be 'auto', 'amx', 'avx512_bf16' or 'avx512_fp32', got 'tiles'"):
        paged_prefill_attention(query, kv_cache, table, lens, starts, 0.1, None, "tiles")
    with pytest.raises(RuntimeError, match="products='avx512_fp32' takes float32 inputs, got BFloat16"):
        paged_prefill_attention(query, kv_cache, table, lens, starts, 0.1, None, "avx512_fp32")
    with pytest.raises(RuntimeError, match="products='avx512_bf16' takes bfloat16 inputs, got Float"):
        paged_prefill_attention(query.float(), kv_cache.float(), table, lens, starts, 0.1, None, "avx512_bf16")
    with pytest.raises(RuntimeError, match=r"kv_cache .* of the query's dtype \(Float\) expected"):
        paged_prefill_attention(query.float(), kv_cache, table, lens, starts, 0.1)
    if "amx" not in cpu_native.prefill_attention_products():
        with pytest.raises(RuntimeError, match="products='amx' is not available"):
            paged_prefill_attention(query, kv_cache, table, lens, starts, 0.1, None, "amx")


def test_op_registration_and_fake_impl() -> None:
    query, kv_cache, metadata = _prefill_inputs([20, 33], [20, 40], 4, 2, 64, 16)
    args = (query, kv_cache, metadata.block_table, metadata.seq_lens, metadata.query_start_loc, 0.125, None)
    torch.library.opcheck(torch.ops.pagedserve.paged_prefill_attention.default, args)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = paged_prefill_attention(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert fake.shape == query.shape and fake.dtype == BF16


@pytest.fixture
def kernel_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = cpu_native.paged_prefill_attention
    monkeypatch.setattr(cpu_native, "paged_prefill_attention", lambda *args: calls.append(1) or real(*args))
    return calls


@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("sliding_window", [None, 37])
def test_backend_prefills_match_torch_paged(kernel_calls, dtype, sliding_window) -> None:
    """Decodes first, then fresh prompts and chunks behind cached prefixes, then padding rows."""
    query_lens = [1, 1, 9, 20, 150, 1, 64]
    seq_lens = [40, 300, 9, 70, 150, 33, 600]
    query, key, value, kv_cache, metadata = _step(query_lens, seq_lens, 9, 3, 64, 16, dtype, num_padding_tokens=3)
    expected = TorchPagedAttentionBackend().forward(query, key, value, kv_cache.clone(), metadata, 0.125,
                                                    sliding_window)
    actual = CpuNativeAttentionBackend().forward(query, key, value, kv_cache, metadata, 0.125, sliding_window)
    assert kernel_calls == [1]
    tolerance = 1e-2 if dtype == BF16 else 2e-5
    torch.testing.assert_close(actual.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert torch.all(actual[-3:] == 0)


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 80), (BF16, 80)], ids=["float32", "bfloat16"])
def test_other_prefills_take_the_torch_paged_path(kernel_calls, dtype, head_dim) -> None:
    query, key, value, kv_cache, metadata = _step([1, 30, 50], [20, 30, 90], 4, 2, head_dim, 16, dtype)
    expected = TorchPagedAttentionBackend().forward(query, key, value, kv_cache.clone(), metadata, 0.1)
    actual = CpuNativeAttentionBackend().forward(query, key, value, kv_cache, metadata, 0.1)
    assert kernel_calls == []
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(actual.float(), expected.float(), **tolerance)


def _max_logprob_deviation(reference, outputs) -> tuple[float, int]:
    """The largest |logprob difference| over the top tokens of the steps where both runs still agree on every
    token so far, and how many such steps there were."""
    deviation, num_steps = 0.0, 0
    for (reference_tokens, reference_steps), (tokens, steps) in zip(reference, outputs):
        for step, (expected, actual) in enumerate(zip(reference_steps, steps)):
            if reference_tokens[:step + 1] != tokens[:step + 1]:
                break
            num_steps += 1
            deviation = max(deviation, max(abs(actual[t] - v) for t, v in expected.items() if t in actual))
    return deviation, num_steps


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_bfloat16_engine_logprobs_close_to_float32(tiny_model_dir, kind: str, kernel_calls) -> None:
    """bf16 engine, head_dim 64, chunked prefill (64-token steps) and prefix caching (prompts sharing 80 tokens):
    with the prefill kernel the logprobs stay as close to a float32 run as the torch_paged backend's bf16 run
    (measured: 0.047-0.051 against 0.061-0.066)."""
    from logprobs_check import check_logprobs_close
    from pagedserve import LLM, SamplingParams

    folder = tiny_model_dir(kind, dtype=BF16, hidden_size=256, head_dim=64)
    rng = random.Random(5)
    shared = [rng.randrange(8, 400) for _ in range(80)]
    prompts = [shared + [rng.randrange(8, 400) for _ in range(rng.randint(3, 70))] for _ in range(3)]
    prompts += [[rng.randrange(8, 400) for _ in range(n)] for n in (5, 17, 130)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)

    def run(backend: str, dtype: str):  # type: ignore[no-untyped-def]
        llm = LLM(folder, dtype=dtype, max_model_len=256, num_kv_blocks=128, max_num_batched_tokens=64,
                  enable_prefix_caching=True, attention_backend=backend)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
                for o in outputs]

    reference = run("torch_paged", "float32")
    sdpa = run("torch_paged", "bfloat16")
    assert kernel_calls == []
    native = run("cpu_native", "bfloat16")
    assert len(kernel_calls) >= 2 * 2, "chunked prefills of both layers must run on the kernel"
    check_logprobs_close(reference, native, "float32", "cpu_native bf16")
    sdpa_deviation, _ = _max_logprob_deviation(reference, sdpa)
    native_deviation, num_steps = _max_logprob_deviation(reference, native)
    assert num_steps >= 100
    assert native_deviation <= max(0.1, 1.5 * sdpa_deviation), (native_deviation, sdpa_deviation)


# int8 KV (the kernel's int8 pack phase) is slow here: tests/attention/test_native_int8_prefill.py's backend test
# covers the same code, and e2e/test_int8_kv_cache_engine.py runs it in engines.
@pytest.mark.parametrize("kv_cache_dtype", ["auto", pytest.param("int8", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_float32_engine_greedy_tokens_equal_torch_paged(tiny_model_dir, kind: str, kv_cache_dtype: str,
                                                        kernel_calls) -> None:
    """float32 engine, chunked prefill (64-token steps) and prefix caching (prompts sharing 80 tokens), with the
    model-dtype or the int8 KV cache: the kernel's prefills give the same greedy tokens over 40 steps as the
    torch_paged backend (its own reference), and logprobs within fp32 noise."""
    from pagedserve import LLM, SamplingParams

    folder = tiny_model_dir(kind, dtype=torch.float32, hidden_size=256, head_dim=64)
    rng = random.Random(7)
    shared = [rng.randrange(8, 400) for _ in range(80)]
    prompts = [shared + [rng.randrange(8, 400) for _ in range(rng.randint(3, 70))] for _ in range(3)]
    prompts += [[rng.randrange(8, 400) for _ in range(n)] for n in (5, 17, 130)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=3)

    def run(backend: str):  # type: ignore[no-untyped-def]
        llm = LLM(folder, dtype="float32", max_model_len=256, num_kv_blocks=128, max_num_batched_tokens=64,
                  enable_prefix_caching=True, attention_backend=backend, kv_cache_dtype=kv_cache_dtype)
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    reference = run("torch_paged")
    assert kernel_calls == []
    native = run("cpu_native")
    assert len(kernel_calls) >= 2 * 2, "chunked prefills of both layers must run on the kernel"
    for expected, actual in zip(reference, native):
        assert actual.outputs[0].token_ids == expected.outputs[0].token_ids
        for expected_step, actual_step in zip(expected.outputs[0].logprobs, actual.outputs[0].logprobs):
            for token, logprob in expected_step.items():
                assert abs(actual_step[token].logprob - logprob.logprob) < 1e-3
