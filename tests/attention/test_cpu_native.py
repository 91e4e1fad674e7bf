"""The 'cpu_native' backend (native in-place paged decode kernel) against torch_paged, the oracle.

Kernel-level: random paged caches with shuffled blocks, GQA ratios 1/3/4, head_dim 64/128 (the unrolled
paths) and odd shapes (the generic path), block sizes 16/32, context lengths 1..600 with partial blocks,
sliding windows, one long request split over many partitions, and batch invariance (bitwise). Backend
level: mixed decode + prefill + padding steps, strided (fused-QKV) queries. End to end: greedy tokens
identical to HF transformers and to the torch_paged backend. Plus the fallback when the build fails.
"""
from __future__ import annotations

import logging
import math
import os
import random
import subprocess
import sys

import pytest
import torch

from pagedserve.kernels import cpu_library as cpu_native_extension
from pagedserve.attention import get_attention_backend
from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.cpu_native import (DECODE_PARTITION_TOKENS, CpuNativeAttentionBackend,
                                             paged_decode_attention)
from pagedserve.attention.torch_paged import TorchPagedAttentionBackend

TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


@pytest.fixture(scope="module", autouse=True)
def native_extension() -> None:
    """Builds (first run on this CPU only: cached under ~/.cache/pagedserve/extensions) and loads once."""
    cpu_native_extension.load_native_extension()


def _step(query_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
          block_size: int, dtype: torch.dtype, seed: int = 0, num_padding_tokens: int = 0):
    """A random paged cache (shuffled blocks, stale data everywhere) and one step's inputs and metadata.

    Request i adds query_lens[i] tokens and ends at seq_lens[i]; the leading single-token requests are decodes.
    """
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    blocks_per_request = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_request) + 3
    block_ids = list(range(1, num_blocks))
    rng.shuffle(block_ids)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    max_blocks = max(blocks_per_request) + 2  # padded with the null block, as the runner does
    rows, slots, cursor = [], [], 0
    for num_request_blocks, query_len, seq_len in zip(blocks_per_request, query_lens, seq_lens):
        row = block_ids[cursor:cursor + num_request_blocks]
        cursor += num_request_blocks
        rows.append(row + [0] * (max_blocks - len(row)))
        slots += [row[p // block_size] * block_size + p % block_size for p in range(seq_len - query_len, seq_len)]
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    num_tokens = starts[-1]
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        slot_mapping=torch.tensor(slots + [0] * num_padding_tokens, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor(rows, dtype=torch.int32), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        num_decodes=num_decodes, num_decode_tokens=num_decodes, query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens), block_size=block_size)
    total = num_tokens + num_padding_tokens
    query = torch.randn(total, num_heads, head_dim, generator=generator).to(dtype)
    key = torch.randn(total, num_kv_heads, head_dim, generator=generator).to(dtype)
    value = torch.randn(total, num_kv_heads, head_dim, generator=generator).to(dtype)
    return query, key, value, kv_cache, metadata


def _compare_backends(query, key, value, kv_cache, metadata, dtype, sliding_window=None) -> torch.Tensor:
    scale = query.shape[-1] ** -0.5
    expected = TorchPagedAttentionBackend().forward(query, key, value, kv_cache.clone(), metadata, scale,
                                                    sliding_window)
    actual = CpuNativeAttentionBackend().forward(query, key, value, kv_cache, metadata, scale, sliding_window)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[dtype])
    return actual


def _random_lengths(count: int, seed: int, low: int = 1, high: int = 600) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(count)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2)], ids=["gqa1", "gqa3", "gqa4"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decodes_match_torch_paged(dtype, num_heads, num_kv_heads, head_dim, block_size) -> None:
    # Lengths 1..600 (partial blocks, one and several partitions) plus the edges.
    seq_lens = _random_lengths(10, seed=head_dim + block_size) + [1, block_size, block_size + 1,
                                                                  DECODE_PARTITION_TOKENS, DECODE_PARTITION_TOKENS + 1]
    inputs = _step([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    _compare_backends(*inputs, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [5, 7, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_large_groups_match_torch_paged(dtype, group: int, head_dim: int) -> None:
    """Groups above 4 (the unrolled path computes scores for 4 heads per sweep over the keys) and, at head_dim
    128, value passes over part of head_dim at a time (2 or 3 vectors of 16 per pass, one partial pass)."""
    seq_lens = _random_lengths(6, seed=group * head_dim) + [1, 3, 258]
    inputs = _step([1] * len(seq_lens), seq_lens, group * 2, 2, head_dim, 16, dtype, seed=group)
    _compare_backends(*inputs, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sliding_window", [1, 7, 37, 300])
def test_sliding_window(dtype, sliding_window: int) -> None:
    seq_lens = _random_lengths(12, seed=sliding_window) + [1, 5, 600]
    inputs = _step([1] * len(seq_lens), seq_lens, 6, 2, 64, 16, dtype, seed=sliding_window)
    _compare_backends(*inputs, dtype, sliding_window=sliding_window)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(12, 1, 64), (4, 2, 24), (3, 3, 80)],
                         ids=["group12", "head_dim24", "head_dim80"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_generic_path(num_heads, num_kv_heads, head_dim, dtype) -> None:
    """Shapes without an unrolled variant (group > 8, head_dim not 64/128, not a multiple of 16)."""
    seq_lens = _random_lengths(6, seed=head_dim) + [1, 513]
    inputs = _step([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, 16, dtype)
    _compare_backends(*inputs, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_long_request_is_split_and_thread_count_invariant(dtype) -> None:
    """3000 tokens: 12 partitions merged flash-decoding style; the same bits with 1 or 2 threads."""
    query, key, value, kv_cache, metadata = _step([1], [3000], 8, 2, 64, 16, dtype, seed=3)
    actual = _compare_backends(query, key, value, kv_cache, metadata, dtype)
    threads = torch.get_num_threads()
    try:
        results = []
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            results.append(paged_decode_attention(query, kv_cache, metadata.block_table, metadata.seq_lens,
                                                  64 ** -0.5))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])
    assert torch.equal(results[0], actual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_matches_float64_attention(dtype) -> None:
    """Direct check of the kernel's math against dense float64 attention (no torch_paged in between)."""
    seq_lens = [1, 17, 255, 256, 257, 600]
    query, _, _, kv_cache, metadata = _step([1] * len(seq_lens), seq_lens, 6, 2, 64, 16, dtype, seed=5)
    scale = 0.125
    actual = paged_decode_attention(query, kv_cache, metadata.block_table, metadata.seq_lens, scale)
    for index, seq_len in enumerate(seq_lens):
        positions = torch.arange(seq_len)
        slots = metadata.block_table[index].long()[positions // 16] * 16 + positions % 16
        flat = kv_cache.double().view(2, -1, 2, 64)
        keys = flat[0, slots].repeat_interleave(3, dim=1)  # [seq_len, H, D]
        values = flat[1, slots].repeat_interleave(3, dim=1)
        scores = torch.einsum("hd,khd->hk", query[index].double(), keys) * scale
        expected = torch.einsum("hk,khd->hd", scores.softmax(-1), values)
        torch.testing.assert_close(actual[index].double(), expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sliding_window", [None, 100])
def test_batch_invariance_bitwise(dtype, sliding_window) -> None:
    """A request's output has the same bits alone and at any position inside random batches."""
    probe_len = 517
    others = _random_lengths(40, seed=11, high=1500)
    seq_lens = [probe_len] + others
    query, _, _, kv_cache, metadata = _step([1] * len(seq_lens), seq_lens, 9, 3, 64, 16, dtype, seed=7)
    table, lengths, scale = metadata.block_table, metadata.seq_lens, 0.125
    alone = paged_decode_attention(query[:1], kv_cache, table[:1], lengths[:1], scale, sliding_window)
    rng = random.Random(0)
    for batch_size in (2, 7, 41):
        members = [0] + rng.sample(range(1, len(seq_lens)), batch_size - 1)
        rng.shuffle(members)
        order = torch.tensor(members)
        batched = paged_decode_attention(query[order], kv_cache, table[order], lengths[order], scale,
                                         sliding_window)
        assert torch.equal(batched[members.index(0)], alone[0]), f"batch of {batch_size}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mixed_step_with_prefills_and_padding(dtype) -> None:
    """Decodes first, then a fresh prompt and a prefill chunk behind a cached prefix, then padding rows."""
    query_lens = [1, 1, 1, 9, 20]
    seq_lens = [40, 300, 1, 9, 70]
    inputs = _step(query_lens, seq_lens, 6, 2, 64, 16, dtype, num_padding_tokens=3)
    output = _compare_backends(*inputs, dtype)
    assert torch.all(output[-3:] == 0)


def test_strided_query_from_fused_qkv() -> None:
    """The Attention layer passes views into one fused QKV output: row stride != num_heads * head_dim."""
    num_heads, num_kv_heads, head_dim = 6, 2, 64
    query, key, value, kv_cache, metadata = _step([1] * 5, [3, 50, 600, 16, 257], num_heads, num_kv_heads,
                                                  head_dim, 16, torch.float32)
    fused = torch.cat([query.flatten(1), key.flatten(1), value.flatten(1)], dim=1)
    query_view, key_view, value_view = (part.view(5, -1, head_dim) for part in fused.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1))
    assert not query_view.is_contiguous()
    _compare_backends(query_view, key_view, value_view, kv_cache, metadata, torch.float32)


def test_decode_only_step_fast_path_validates_and_matches(monkeypatch) -> None:
    """A decode-only step without padding takes the short path (the kernel's result is the output, no copy):
    same result as torch_paged, and bad shapes still raise, also after a good layer of the same step."""
    query, key, value, kv_cache, metadata = _step([1] * 4, [3, 50, 600, 17], 6, 2, 64, 16, torch.bfloat16)
    copies = []
    real_forward = TorchPagedAttentionBackend.forward
    monkeypatch.setattr(TorchPagedAttentionBackend, "forward", lambda *args: copies.append(1) or real_forward(*args))
    expected = real_forward(TorchPagedAttentionBackend(), query, key, value, kv_cache.clone(), metadata, 0.125)
    backend = CpuNativeAttentionBackend()
    actual = backend.forward(query, key, value, kv_cache, metadata, 0.125)
    assert copies == []  # the short path never falls back to the general forward
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[torch.bfloat16])
    with pytest.raises(ValueError, match="kv_cache shape"):
        backend.forward(query, key, value, kv_cache[..., :32].contiguous(), metadata, 0.125)
    with pytest.raises(ValueError, match="sliding_window=0"):
        backend.forward(query, key, value, kv_cache, metadata, 0.125, 0)


def test_bad_inputs_raise() -> None:
    query, _, _, kv_cache, metadata = _step([1, 1], [20, 33], 4, 2, 64, 16, torch.float32)
    with pytest.raises(RuntimeError, match="needs more blocks"):
        paged_decode_attention(query, kv_cache, metadata.block_table[:, :1], metadata.seq_lens, 0.1)
    with pytest.raises(RuntimeError, match="must be >= 1"):
        paged_decode_attention(query, kv_cache, metadata.block_table, torch.tensor([0, 5], dtype=torch.int32), 0.1)
    with pytest.raises(RuntimeError, match="int32"):
        paged_decode_attention(query, kv_cache, metadata.block_table.long(), metadata.seq_lens, 0.1)


def test_op_registration_and_fake_impl() -> None:
    """Schema, fake (meta) impl and dispatch are consistent: what torch.compile needs to treat it as opaque."""
    query, _, _, kv_cache, metadata = _step([1, 1, 1], [5, 260, 31], 4, 2, 64, 16, torch.bfloat16)
    torch.library.opcheck(torch.ops.pagedserve.paged_decode_attention.default,
                          (query, kv_cache, metadata.block_table, metadata.seq_lens, 0.125, None, 256))
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = paged_decode_attention(mode.from_tensor(query), mode.from_tensor(kv_cache),
                                      mode.from_tensor(metadata.block_table), mode.from_tensor(metadata.seq_lens), 0.1)
    assert fake.shape == query.shape and fake.dtype == query.dtype


def test_build_failure_falls_back_to_torch_paged(monkeypatch, caplog) -> None:
    """No compiler (simulated): the CPU default is torch_paged, one warning; asking for cpu_native raises."""
    from pagedserve.platforms.cpu import CpuPlatform

    def failing_build(level: str) -> None:
        raise RuntimeError("simulated: no C++ compiler")

    monkeypatch.setattr(cpu_native_extension, "_build_and_load", failing_build)
    monkeypatch.setattr(cpu_native_extension, "_state", None)
    with caplog.at_level(logging.WARNING, logger=cpu_native_extension.__name__):
        assert CpuPlatform().default_attention_backend() == "torch_paged"
        assert CpuPlatform().default_attention_backend() == "torch_paged"
    warnings = [record for record in caplog.records if "simulated: no C++ compiler" in record.getMessage()]
    assert len(warnings) == 1
    with pytest.raises(RuntimeError, match="attention_backend='torch_paged'"):
        get_attention_backend("cpu_native")


def test_default_backend_is_cpu_native_when_built() -> None:
    from pagedserve.platforms.cpu import CpuPlatform

    assert CpuPlatform().default_attention_backend() == "cpu_native"
    assert get_attention_backend("torch_paged").name == "torch_paged"


def test_second_start_loads_the_cached_library_without_building() -> None:
    """A fresh process finds the library in the cache: cpp_extension.load (the compiler) is never called."""
    directory = cpu_native_extension.extension_dir(cpu_native_extension.loaded_level())
    assert any(path.suffix == ".so" for path in directory.iterdir())
    code = (
        "import torch.utils.cpp_extension as c\n"
        "def no_build(*a, **k): raise AssertionError('rebuilt')\n"
        "c.load = no_build\n"
        "from pagedserve.kernels import cpu_library as e\n"
        "e.load_native_extension()\n"
        "import torch\n"
        "assert hasattr(torch.ops.pagedserve, 'paged_decode_attention')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ),
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def _attention_backend_names(llm) -> set[str]:
    from pagedserve.layers.attention import Attention

    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    return {module.backend.name for module in model.modules() if isinstance(module, Attention)}


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_llm_greedy_equals_transformers(tiny_model_dir, kind: str) -> None:
    """End to end, float32, 32 greedy tokens: cpu_native == HF; and == torch_paged (the on/off check)."""
    from transformers import AutoConfig

    from e2e.test_hf_parity import NUM_LOGPROBS, NUM_NEW_TOKENS, _prompts
    from hf_reference import hf_greedy_with_logprobs
    from logprobs_check import check_outputs_equal
    from pagedserve import LLM, SamplingParams

    folder = tiny_model_dir(kind)
    vocab_size = AutoConfig.from_pretrained(folder).vocab_size
    # Lengths straddle blocks (16) and, for mistral, exceed the sliding window (16).
    prompts = _prompts(vocab_size, (5, 16, 17, 40, 70))
    expected = [tokens for tokens, _ in hf_greedy_with_logprobs(folder, prompts, NUM_NEW_TOKENS, NUM_LOGPROBS)]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    results = {}
    for backend in ("cpu_native", "torch_paged"):
        llm = LLM(folder, dtype="float32", max_model_len=256, num_kv_blocks=256, max_num_seqs=4,
                  attention_backend=backend)
        assert _attention_backend_names(llm) == {backend}
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[backend] = [list(output.outputs[0].token_ids) for output in outputs]
    check_outputs_equal(expected, results["cpu_native"])
    assert results["cpu_native"] == results["torch_paged"]


def test_attention_backend_knob_validation_and_cli_flag(tiny_model_dir) -> None:
    import argparse

    from pagedserve.config.cli_args import add_engine_args, engine_kwargs_from_args
    from pagedserve.config.engine import EngineConfig

    folder = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="attention_backend='nope' must be one of"):
        EngineConfig.create(folder, attention_backend="nope")
    assert EngineConfig.create(folder).attention_backend == "cpu_native"  # the CPU default once built
    assert EngineConfig.create(folder, attention_backend="torch_paged").attention_backend == "torch_paged"
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--attention-backend", "torch_paged"])
    assert engine_kwargs_from_args(args)["attention_backend"] == "torch_paged"


def test_prune_extension_cache_keeps_the_most_recently_used(tmp_path) -> None:
    """After a build the cache keeps the new build and the most recently used others; names that are not build
    keys are never touched."""
    keys = [f"{index:020x}" for index in range(6)]
    for age, key in enumerate(keys):  # keys[0] the most recently used
        (tmp_path / key).mkdir()
        (tmp_path / key / "lib.so").write_bytes(b"x")
        os.utime(tmp_path / key, (1_000_000 - age, 1_000_000 - age))
    (tmp_path / "notes").mkdir()
    (tmp_path / "0123").mkdir()  # too short for a key
    current = keys[5]  # just built (its mtime does not matter: it always stays)
    removed = cpu_native_extension.prune_extension_cache(tmp_path, current, num_kept=3)
    assert sorted(path.name for path in removed) == sorted(keys[2:5])
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([keys[0], keys[1], current, "notes", "0123"])
    assert cpu_native_extension.prune_extension_cache(tmp_path, current, num_kept=3) == []


def test_loading_marks_the_build_as_used() -> None:
    directory = cpu_native_extension.extension_dir(cpu_native_extension.loaded_level())
    os.utime(directory, (1_000_000, 1_000_000))
    code = "from pagedserve.kernels import cpu_library as e\ne.load_native_extension()\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ),
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert directory.stat().st_mtime > 1_000_000
