"""Skip marks for tests that need a native CPU kernel build (kernels/cpu_library.py)."""
from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_isa
from pagedserve.layers.gguf_linear import gguf_kernels_available

NEEDS_GGUF_KERNELS = pytest.mark.skipif(
    not gguf_kernels_available(),
    reason="no native CPU kernel build here (PAGEDSERVE_CPU_ISA=none, or a CPU without one): GGUF weights load "
           "dequantized, the path tests/model_loader/test_gguf_loader.py covers")

# torch's CPU flash attention (scaled_dot_product_attention) packs bfloat16 blocks for AMX whenever the hardware has
# AMX, even when ATEN_CPU_CAPABILITY holds ATen below AVX-512, and then fails ("pack_vnni2 is only supported when
# avx512 is supported"). Only the ISA-level children of tests/kernels/test_isa_levels.py run so on an AMX machine;
# a real AVX2 CPU has no AMX and never packs.
ATEN_BF16_ATTENTION_BROKEN = ("amx" in cpu_isa.cpu_levels()
                              and torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX512_BF16", "AMX"))
NEEDS_ATEN_BF16_ATTENTION = pytest.mark.skipif(
    ATEN_BF16_ATTENTION_BROKEN,
    reason="ATEN_CPU_CAPABILITY below AVX-512 on an AMX CPU: torch's bfloat16 flash attention packs for AMX anyway "
           "and fails (pack_vnni2); the test runs at the machine's own level and on real AVX2 CPUs")
