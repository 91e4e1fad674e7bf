"""Whether nn.Module forward hooks would fire: the check native fast paths make before standing in for modules."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn


def hook_registries(modules: Iterable[nn.Module]) -> tuple[dict[Any, Any], ...]:
    """The forward-hook and pre-hook dicts of `modules`. Registering a hook adds to them in place, so a tuple
    collected once stays current."""
    return tuple(hooks for module in modules for hooks in (module._forward_hooks, module._forward_pre_hooks))


def has_forward_hooks(registries: Iterable[dict[Any, Any]]) -> bool:
    """Whether a forward hook or pre-hook is registered globally or in any of `registries` (see hook_registries)."""
    return bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks
                or any(registries))


__all__ = ["has_forward_hooks", "hook_registries"]
