"""layers/forward_hooks.py: whether nn.Module forward hooks would fire, and ForwardHookCheck's per-step answer.

ForwardHookCheck looks at the registries only when a hook handle was made since a look that found none, or while
hooks were present: every registration (per module or global, hook or pre-hook) and every removal is seen at the
next call, and steady calls do not look.
"""
from __future__ import annotations

import pytest
from torch import nn

from pagedserve.layers import forward_hooks
from pagedserve.layers.forward_hooks import ForwardHookCheck, has_forward_hooks, hook_registries


def _hook(*args) -> None:
    return None


@pytest.mark.parametrize("register", [
    lambda module: module.register_forward_hook(_hook),
    lambda module: module.register_forward_pre_hook(_hook),
    lambda module: nn.modules.module.register_module_forward_hook(_hook),
    lambda module: nn.modules.module.register_module_forward_pre_hook(_hook),
])
def test_registration_and_removal_are_seen(register) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    check = ForwardHookCheck(hook_registries(model.modules()))
    assert not check() and not check()
    handle = register(model[1])
    assert check() and check()
    handle.remove()
    assert not check()
    assert has_forward_hooks(check.registries) is False


def test_steady_calls_do_not_look(monkeypatch) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    check = ForwardHookCheck(hook_registries(model.modules()))
    looks = []
    monkeypatch.setattr(forward_hooks, "has_forward_hooks", lambda registries: looks.append(1) or False)
    for _ in range(5):
        assert not check()
    assert len(looks) == 1
    nn.Linear(2, 2).register_forward_hook(_hook)  # any new handle, even another module's: look again
    assert not check() and len(looks) == 2
