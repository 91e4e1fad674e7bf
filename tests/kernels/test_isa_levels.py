"""Every ISA level this machine can run is tested, not only the one the main run selects.

The main pytest run uses the level the CPU and PAGEDSERVE_CPU_ISA select. These tests start a child pytest with
PAGEDSERVE_CPU_ISA=<level> (each level builds its own library at first use) for:
- every other supported level: the native kernels' tests (marker `native_kernels`, the modules of
  tests/native_kernel_modules.py, which the child collects alone), each kernel against its plain reference, bitwise
  where it claims bits; above avx2 without the tests that build an engine (marker `engine`: they run at the main
  run's level and at avx2);
- the avx2 cap, on machines above it: representative engine tests (HF parity, bfloat16, the decode stack, batch
  invariance), so the level most CPUs run is tested end to end wherever the suite runs; they run in the same child
  as the avx2 level's native kernels' tests (the decode stack's module is one of those: it runs once there);
- 'none' (no native kernels, as on aarch64): the engine against transformers on its plain-PyTorch paths.
ATen runs at the same level in the child (ATEN_CPU_CAPABILITY): the kernels' bitwise claims compare them with ATen's
vector code of the same width, as on a CPU of that level (platforms/sdpa_backends.py keeps torch's bfloat16 attention
off its AMX packing there).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from native_kernel_modules import NATIVE_KERNEL_TEST_MODULES
from pagedserve.kernels import cpu_isa

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE_TESTS_AT_AVX2 = ("tests/e2e/test_hf_parity.py", "tests/e2e/test_batch_invariance.py",
                        "tests/models/test_native_decode_stack.py")
ENGINE_TESTS_WITHOUT_KERNELS = ("tests/e2e/test_hf_parity.py",)
# ATen's CPU capability for each level (ATen has no bf16 or AMX capability of its own).
ATEN_CAPABILITY = {"none": "default", "avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512", "amx": "avx512"}
CHILD_TIMEOUT_S = 1200


def _run_pytest_at(level: str, *arguments: str, markers: str = "not slow") -> None:
    environment = dict(os.environ, **{cpu_isa.CAP_ENV: level, "ATEN_CPU_CAPABILITY": ATEN_CAPABILITY[level]})
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", markers, *arguments]
    result = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True,
                            timeout=CHILD_TIMEOUT_S)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"pytest at {cpu_isa.CAP_ENV}={level} failed:\n{output[-6000:]}"
    passed = re.search(r"(\d+) passed", output)
    assert passed is not None and int(passed.group(1)) > 0, f"nothing ran at {level}:\n{output[-3000:]}"


def modules_at(level: str) -> tuple[str, ...]:
    """The test modules a child at `level` runs: the native kernels' modules, and at avx2 the engine tests too
    (each module once)."""
    engine_modules = ENGINE_TESTS_AT_AVX2 if level == "avx2" else ()
    return tuple(dict.fromkeys(NATIVE_KERNEL_TEST_MODULES + engine_modules))


def test_modules_at_avx2_hold_the_engine_tests_once() -> None:
    assert set(ENGINE_TESTS_AT_AVX2) <= set(modules_at("avx2"))
    assert set(NATIVE_KERNEL_TEST_MODULES) <= set(modules_at("avx2"))
    assert len(modules_at("avx2")) == len(set(modules_at("avx2")))
    assert not set(ENGINE_TESTS_AT_AVX2) - set(NATIVE_KERNEL_TEST_MODULES) & set(modules_at("avx512"))
    assert all(os.path.isfile(os.path.join(ROOT, module)) for module in modules_at("avx2"))


@pytest.mark.parametrize("level", cpu_isa.LEVELS[1:])
def test_native_kernel_tests_at_every_level(level: str) -> None:
    """The native kernels' tests at `level`; at avx2, on machines above it, the engine tests too (every test of the
    modules); above avx2 the tests that build no engine."""
    if level not in cpu_isa.cpu_levels():
        pytest.skip(f"this CPU has no {level} (it supports {', '.join(cpu_isa.cpu_levels())})")
    if level == cpu_isa.selected_level():
        pytest.skip(f"{level} is the level of this run: its native_kernels and engine tests ran at it here")
    # The engine modules hold tests not marked native_kernels: `-m "not slow"` selects them all, as it selects every
    # test of the native kernels' modules (each one is marked native_kernels). Above avx2 the kernels' own tests
    # only: the tests that build an engine (marked `engine`) ran at this run's level and run at avx2, and repeating
    # them at every level cost the suite ~15 minutes on an AMX machine.
    _run_pytest_at(level, *modules_at(level), markers="not slow" if level == "avx2" else "not slow and not engine")


def test_engine_without_native_kernels() -> None:
    if cpu_isa.selected_level() == "none":
        pytest.skip("this run has no native kernels already")
    _run_pytest_at("none", *ENGINE_TESTS_WITHOUT_KERNELS)
