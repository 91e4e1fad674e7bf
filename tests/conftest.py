"""Shared pytest fixtures: tiny HF model folders built offline, once per session per kind."""
from __future__ import annotations

import os
import sys
from typing import Callable

import pytest

# Make `import tiny_models` work from any test module, whatever rootdir/import mode pytest uses.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from native_kernel_modules import NATIVE_KERNEL_TEST_MODULES  # noqa: E402
from tiny_models import build_tiny_model, build_tiny_tokenizer  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the native kernels' tests `native_kernels` (tests/native_kernel_modules.py), and those that build an
    engine on a tiny model folder `engine` (the ISA-level children run these at the avx2 cap only)."""
    for item in items:
        if os.path.relpath(str(item.path), _ROOT) in NATIVE_KERNEL_TEST_MODULES:
            item.add_marker(pytest.mark.native_kernels)
        if "tiny_model_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.engine)


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


@pytest.fixture(params=["amx", "avx512_bf16", "avx512", "avx2"])
def linear_products(request: pytest.FixtureRequest) -> str:
    """Each product unit of the tile-packed bf16 linear kernels (kernels/cpu/amx_linear.cpp) that this CPU and
    process can run (an AVX512-BF16 build: 'amx' and 'avx512_bf16'; an AVX-512 build without BF16: 'avx512'; an
    AVX2 build: 'avx2'); the others skip."""
    from pagedserve.layers.amx_linear import amx_linear_products

    if request.param not in amx_linear_products():
        pytest.skip(f"no {request.param} here (available: {amx_linear_products()})")
    return request.param

