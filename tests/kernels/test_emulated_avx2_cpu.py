"""The engine on an AVX2-only CPU, emulated: QEMU's user-mode emulator (`qemu-x86_64 -cpu EPYC-Milan`, an AMD Zen 3
without AVX-512) runs a child pytest, where Debian's qemu-user is installed (CI installs it).

The avx2 level's tests (tests/kernels/test_isa_levels.py) cap pagedserve's and ATen's dispatch on this machine, but
the libraries under them still see the host's CPUID: oneDNN packs bfloat16 weights and MKL runs its AVX-512 code,
which an AVX2-only CPU cannot (`LLM(dtype="bfloat16")` once died at load there). Under the emulator every CPUID
query answers Zen 3's features, as on the real CPU, and an instruction beyond them stops the child with SIGILL: the
avx2 build and every path the selected tests reach run only what an AVX2 CPU has. Emulation is ~30x slower than the
host, so the child runs a few representative tests: the weight layouts the CPU can run, and the engine against
transformers in float32 and bfloat16 with the native kernels on.

/proc/cpuinfo is the host's under qemu-user, so the child caps pagedserve's level at avx2 itself (on a real Zen 3
the flags there say avx2). Programs the child starts (the compiler, when the avx2 build is not cached yet) run on
the host, not emulated: the parent builds the avx2 library before the child starts.
"""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys

import pytest

from pagedserve.kernels import cpu_isa

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EMULATOR = "qemu-x86_64"
# QEMU's model of an AMD EPYC 7003 (Zen 3): AVX2, FMA, F16C, BMI1/2; no AVX-512, no AVX512-BF16, no AMX.
EMULATED_CPU = "EPYC-Milan"
TESTS_ON_THE_EMULATED_CPU = (
    "tests/layers/test_weight_layout.py::test_resolve_weight_layout_per_platform_dtype_and_mode",
    "tests/layers/test_weight_layout.py::test_prepacking_is_probed_per_dtype",
    "tests/layers/test_weight_layout.py::test_prepacked_linear_equals_plain",
    "tests/e2e/test_hf_parity.py::test_float32_greedy_equals_transformers[llama]",
    "tests/e2e/test_hf_parity.py::test_bfloat16_logprobs_close_to_transformers",
)
CHILD_TIMEOUT_S = 1500

pytestmark = [
    pytest.mark.skipif(platform.machine() != "x86_64", reason="emulates an x86-64 CPU on an x86-64 host"),
    pytest.mark.skipif(shutil.which(EMULATOR) is None,
                       reason=f"{EMULATOR} is not installed (Debian: apt-get install qemu-user)"),
    pytest.mark.skipif("avx2" not in cpu_isa.cpu_levels(), reason="this CPU has no avx2 build to run emulated"),
]


def _emulated(command: list[str]) -> list[str]:
    return [EMULATOR, "-cpu", EMULATED_CPU, *command]


def _child_environment() -> dict[str, str]:
    environment = dict(os.environ, **{cpu_isa.CAP_ENV: "avx2"})
    # The emulated CPUID decides ATen's and oneDNN's code, as on the real CPU: no caps inherited from this run.
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        environment.pop(name, None)
    return environment


def test_the_emulated_cpu_is_avx2_only() -> None:
    """The emulator hides AVX-512 from the libraries (else the other test proves nothing)."""
    probe = ("import torch; print(torch.backends.cpu.get_cpu_capability(), "
             "torch.ops.mkldnn._is_mkldnn_bf16_supported())")
    result = subprocess.run(_emulated([sys.executable, "-c", probe]), capture_output=True, text=True,
                            env=_child_environment(), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["AVX2", "False"], result.stdout


def test_engine_tests_pass_on_an_emulated_avx2_only_cpu() -> None:
    # The avx2 build, made on the host (a compile under the emulator would take its timeout).
    build = subprocess.run([sys.executable, "-c", "from pagedserve.kernels import cpu_library; "
                            "cpu_library.load_native_extension()"], cwd=ROOT, env=_child_environment(),
                           capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stderr[-3000:]
    command = _emulated([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                         *TESTS_ON_THE_EMULATED_CPU])
    result = subprocess.run(command, cwd=ROOT, env=_child_environment(), capture_output=True, text=True,
                            timeout=CHILD_TIMEOUT_S)
    output = "\n".join(line for line in (result.stdout + result.stderr).splitlines()
                       if "TCG doesn't support requested feature" not in line)
    assert result.returncode == 0, f"pytest on the emulated {EMULATED_CPU} failed:\n{output[-6000:]}"
    passed = re.search(r"(\d+) passed", output)
    assert passed is not None and int(passed.group(1)) >= len(TESTS_ON_THE_EMULATED_CPU), output[-3000:]
