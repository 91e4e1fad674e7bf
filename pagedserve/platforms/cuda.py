"""The CUDA platform: nccl, device memory, bf16/fp16."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from pagedserve.platforms.interface import Event, Platform


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

    def new_stream(self) -> Any:
        return torch.cuda.Stream()

    def current_stream(self) -> Any:
        return torch.cuda.current_stream()

    def new_event(self) -> "CudaEvent":
        return CudaEvent()

    def wait_event(self, stream: Any, event: Any) -> None:
        (stream or torch.cuda.current_stream()).wait_event(event.event)

    def record_stream(self, tensor: Any, stream: Any) -> None:
        tensor.record_stream(stream)


class CudaEvent(Event):
    def __init__(self) -> None:
        self.event = torch.cuda.Event()

    def record(self, stream: Any = None) -> None:
        self.event.record(stream)
