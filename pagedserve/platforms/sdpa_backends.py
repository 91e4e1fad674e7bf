"""Which scaled_dot_product_attention backends the attention paths let torch choose on the CPU.

torch 2.13's CPU flash attention packs bfloat16 / float16 key and value blocks for AMX whenever the hardware has AMX
(cpuinfo), even when ATEN_CPU_CAPABILITY holds ATen below AVX-512; the pack then fails ("pack_vnni2 is only supported
when avx512 is supported"). That happens on an AMX machine run with ATEN_CPU_CAPABILITY=avx2 or default (the ISA-level
tests do so to compare the avx2 kernels with ATen's AVX2 code). There the math backend runs instead: the same
attention, up to float rounding. Everywhere else torch chooses as usual.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from pagedserve.kernels import cpu_isa

# ATen capabilities at which its AMX packing code is compiled in (torch.backends.cpu.get_cpu_capability()).
_PACKING_CAPABILITIES = ("AVX512", "AVX512_BF16", "AMX")


@functools.cache
def cpu_flash_attention_is_broken() -> bool:
    """True on a CPU with AMX whose ATen runs below AVX-512 (see the module docstring)."""
    has_amx_hardware = cpu_isa.is_x86() and "amx" in cpu_isa.cpu_levels()
    return has_amx_hardware and torch.backends.cpu.get_cpu_capability() not in _PACKING_CAPABILITIES


def cpu_attention_backends(query: torch.Tensor) -> contextlib.AbstractContextManager:
    """The context to run a scaled_dot_product_attention of `query` (and its keys and values) in: the math backend
    for bfloat16 / float16 CPU tensors where the flash backend is broken, torch's own choice otherwise (CUDA
    included)."""
    if (query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16)
            and cpu_flash_attention_is_broken()):
        return sdpa_kernel([SDPBackend.MATH])
    return contextlib.nullcontext()


__all__ = ["cpu_attention_backends", "cpu_flash_attention_is_broken"]
