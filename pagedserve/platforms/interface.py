"""Platform: every hardware specific the engine needs, behind one interface."""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, Iterator

import torch


class Platform(ABC):
    device_type: str = "cpu"
    dist_backend: str = "gloo"

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    @abstractmethod
    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        ...

    def check_dtype(self, dtype: torch.dtype) -> None:
        if dtype not in self.supported_dtypes():
            names = [str(d).removeprefix("torch.") for d in self.supported_dtypes()]
            raise ValueError(
                f"dtype={str(dtype).removeprefix('torch.')!r} is not supported on {self.device_type}; "
                f"supported: {names}"
            )

    @abstractmethod
    def available_memory_bytes(self) -> int:
        """Memory the KV cache may draw from (free RAM on the CPU, free device memory on GPUs)."""

    def allocate_zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor on this platform's device (the KV cache is allocated this way)."""
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def default_attention_backend(self) -> str:
        return "torch_paged"

    def place_weights(self, model: "torch.nn.Module") -> None:
        """Called by each worker once its model is loaded and its weights have their layout: move them where
        this platform reads them fastest (load_config.huge_page_weights; nothing by default)."""
        return None

    def prepare_for_serving(self) -> None:
        """Called by each worker once its model and KV cache are in place, before the first step."""
        return None

    def synchronize(self) -> None:
        return None

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        # No streams on the CPU: work runs in program order.
        yield

    # ---- streams and events (multistream overlap) -------------------------------------------------
    # On the CPU every operation runs in program order, so streams are None and events are no-ops;
    # device platforms return real objects. Callers never branch on the platform.
    def new_stream(self) -> Any:
        """A side stream for overlapping work (None where there are no streams)."""
        return None

    def current_stream(self) -> Any:
        return None

    def new_event(self) -> "Event":
        return NullEvent()

    def wait_event(self, stream: Any, event: "Event") -> None:
        """Make `stream` (None: the current stream) wait until `event` has completed."""
        return None

    def record_stream(self, tensor: Any, stream: Any) -> None:
        """Tell the caching allocator that `tensor` is used on `stream` (memory safety across streams)."""
        return None


class Event:
    """The platform-neutral event interface: record on a stream, wait on another."""

    def record(self, stream: Any = None) -> None:
        raise NotImplementedError


class NullEvent(Event):
    """The event of a platform without streams: program order already orders everything."""

    def record(self, stream: Any = None) -> None:
        return None
