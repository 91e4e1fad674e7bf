"""Shared pytest fixtures: tiny HF model folders built offline, once per session per kind."""
from __future__ import annotations

import os
import sys
from typing import Callable

import pytest

# Make `import tiny_models` work from any test module, whatever rootdir/import mode pytest uses.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_models import build_tiny_model, build_tiny_tokenizer  # noqa: E402

# The native kernels' tests (each kernel against its plain reference, and the decode stack against the modules):
# marked `native_kernels`, so that tests/kernels/test_isa_levels.py runs them once more at every other ISA level the
# machine supports (PAGEDSERVE_CPU_ISA=<level> in a child pytest).
NATIVE_KERNEL_TEST_MODULES = (
    "tests/attention/test_cpu_native.py", "tests/attention/test_native_kv_write.py",
    "tests/attention/test_prefill_attention.py", "tests/attention/test_native_int8_kv.py", "tests/layers/test_amx_gate_up_silu.py",
    "tests/layers/test_amx_linear.py", "tests/layers/test_native_elementwise.py",
    "tests/layers/test_small_batch_linear.py", "tests/models/test_native_decode_stack.py",
    "tests/sample/test_first_argmax.py", "tests/sample/test_fused_greedy_head.py",
    "tests/layers/test_gguf_linear.py", "tests/model_loader/test_gguf_decode_stack.py",
    "tests/quantization/test_w8a8_native_kernel.py", "tests/quantization/test_w8a8_decode_stack.py",
)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if os.path.relpath(str(item.path), _ROOT) in NATIVE_KERNEL_TEST_MODULES:
            item.add_marker(pytest.mark.native_kernels)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """Factory fixture: `tiny_model_dir("llama")` -> path of a tiny HF model folder of that kind.

    Folders are cached per (kind, overrides) for the whole session, so each builds once. Keyword
    arguments are passed to `build_tiny_model` (dtype, seed, max_shard_size, config overrides).
    """
    built: dict[tuple, str] = {}

    def factory(kind: str = "llama", **kwargs: object) -> str:
        key = (kind, tuple(sorted((name, repr(value)) for name, value in kwargs.items())))
        if key not in built:
            folder = tmp_path_factory.mktemp(f"tiny-{kind}")
            built[key] = build_tiny_model(kind, folder, **kwargs)
        return built[key]

    return factory


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A folder holding only the tiny tokenizer (no model)."""
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tiny_tokenizer(folder)
    return str(folder)


@pytest.fixture(params=["amx", "avx512_bf16", "avx2"])
def linear_products(request: pytest.FixtureRequest) -> str:
    """Each product unit of the tile-packed bf16 linear kernels (kernels/cpu/amx_linear.cpp) that this CPU and
    process can run (an AVX512-BF16 build: 'amx' and 'avx512_bf16'; an AVX2 build: 'avx2'); the others skip."""
    from pagedserve.layers.amx_linear import amx_linear_products

    if request.param not in amx_linear_products():
        pytest.skip(f"no {request.param} here (available: {amx_linear_products()})")
    return request.param

