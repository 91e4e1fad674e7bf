"""CustomOp: a module with a plain-PyTorch `forward_native` and optional per-platform variants.

The variant is chosen once, at construction, from the current platform's device type; `forward_native`
is the portable path and the test oracle, and the default for every platform.
"""
from __future__ import annotations

from typing import Any, Callable

from torch import nn

from pagedserve.layers.watched_attributes import WatchedAttributes
from pagedserve.platforms import current_platform


class CustomOp(WatchedAttributes, nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._forward_method: Callable[..., Any] = self._dispatch_forward()

    def _dispatch_forward(self) -> Callable[..., Any]:
        device_type = current_platform().device_type
        if device_type == "cuda":
            return self.forward_cuda
        if device_type == "cpu":
            return self.forward_cpu
        return self.forward_native

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)
