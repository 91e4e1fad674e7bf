"""Whether nn.Module forward hooks would fire: the check native fast paths make before standing in for modules."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle


def hook_registries(modules: Iterable[nn.Module]) -> tuple[dict[Any, Any], ...]:
    """The forward-hook and pre-hook dicts of `modules`. Registering a hook adds to them in place, so a tuple
    collected once stays current."""
    return tuple(hooks for module in modules for hooks in (module._forward_hooks, module._forward_pre_hooks))


def has_forward_hooks(registries: Iterable[dict[Any, Any]]) -> bool:
    """Whether a forward hook or pre-hook is registered globally or in any of `registries` (see hook_registries)."""
    return bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks
                or any(registries))


class ForwardHookCheck:
    """`has_forward_hooks(registries)` for a fixed set of registries, asked once per step by a native fast path.

    Every hook nn.Module registers (per module or global) comes with a new torch.utils.hooks.RemovableHandle, whose
    class counts them (`next_id`). While no handle was made since a check that found no hooks, none can have been
    added, so the answer stands without looking at the registries again: that look touches two dicts per module
    (~360 for SmolLM2-135M), ~30-40 us of a batch-1 decode step on the Zen 4 VM, where the step's weight stream has
    evicted them from every cache. Once hooks were found, every call looks (a removal makes no handle). A hook
    written straight into a module's `_forward_hooks` dict, past nn.Module's API, is seen only at the next look.
    """

    def __init__(self, registries: tuple[dict[Any, Any], ...]) -> None:
        self.registries = registries
        self._handles_at_check = -1  # RemovableHandle.next_id at the last look (-1: never looked)
        self._had_hooks = True

    def __call__(self) -> bool:
        handles = RemovableHandle.next_id
        if handles == self._handles_at_check and not self._had_hooks:
            return False
        self._had_hooks = has_forward_hooks(self.registries)
        self._handles_at_check = handles
        return self._had_hooks


__all__ = ["ForwardHookCheck", "has_forward_hooks", "hook_registries"]
