"""Skip marks for tests that need a native CPU kernel build (kernels/cpu_library.py)."""
from __future__ import annotations

import pytest

from pagedserve.layers.gguf_linear import gguf_kernels_available

NEEDS_GGUF_KERNELS = pytest.mark.skipif(
    not gguf_kernels_available(),
    reason="no native CPU kernel build here (PAGEDSERVE_CPU_ISA=none, or a CPU without one): GGUF weights load "
           "dequantized, the path tests/model_loader/test_gguf_loader.py covers")
