"""The CUDA platform: nccl, device memory, bf16/fp16."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from pagedserve.platforms.interface import Platform


class CudaPlatform(Platform):
    device_type = "cuda"
    dist_backend = "nccl"

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16, torch.float16)

    def available_memory_bytes(self) -> int:
        free, _total = torch.cuda.mem_get_info()
        return int(free)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        with torch.cuda.stream(stream):
            yield
