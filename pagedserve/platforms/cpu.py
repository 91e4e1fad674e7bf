"""The CPU platform: gloo, host RAM, bf16 via oneDNN/AMX when the CPU has it."""
from __future__ import annotations

import os

import torch

from pagedserve.platforms.heap_retention import retain_freed_heap_memory
from pagedserve.platforms.huge_page_memory import allocate_huge_page_zeros, transparent_huge_page_mode
from pagedserve.platforms.huge_page_weights import move_weights_to_huge_pages
from pagedserve.platforms.interface import Platform


class CpuPlatform(Platform):
    device_type = "cpu"
    dist_backend = "gloo"

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        # float16 matmuls on the CPU are slow and lose range; 'auto' maps checkpoints' fp16 to bf16.
        return (torch.float32, torch.bfloat16)

    def allocate_zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Lazily zero-filled and on transparent huge pages (platforms/huge_page_memory.py): a multi-GiB
        KV cache costs nothing at start, memory is committed as blocks are first written (torch.zeros
        would memset it all), and the scattered block writes and reads fault and miss the TLB 512x less."""
        return allocate_huge_page_zeros(shape, dtype)

    def place_weights(self, model: torch.nn.Module) -> None:
        """One arena on transparent huge pages (platforms/huge_page_weights.py): batch-1 decode streams every
        weight once a step, and 2 MiB pages read faster than loading's scattered 4 KiB ones. Where the kernel
        offers no huge pages to advise ('never', or no THP at all) the copy would gain nothing: the weights stay."""
        if transparent_huge_page_mode() in ("always", "madvise"):
            move_weights_to_huge_pages(model)

    def default_attention_backend(self) -> str:
        """'cpu_native' (in-place paged decode kernels) when its C++ extension builds and loads, else the
        portable 'torch_paged'; a failed build is logged once (kernels/cpu_library.py)."""
        from pagedserve.kernels.cpu_library import is_native_extension_available

        return "cpu_native" if is_native_extension_available() else "torch_paged"

    def prepare_for_serving(self) -> None:
        """Steps reuse freed heap memory instead of faulting their activations in again
        (platforms/heap_retention.py; PAGEDSERVE_RETAIN_HEAP=0 turns it off)."""
        retain_freed_heap_memory()

    def available_memory_bytes(self) -> int:
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
