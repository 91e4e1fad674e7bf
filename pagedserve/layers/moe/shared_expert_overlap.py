"""Shared-expert overlap (multistream_overlap_shared_expert): shared experts on a side stream.

DeepSeek/GLM/Qwen2-MoE blocks add a dense "shared expert" to the routed experts' output. Both read the
same input and are independent, so on a device with streams the shared experts run on a second stream
while the main stream routes, dispatches and computes the routed experts:

    main:  record(before) ── router ── routed experts ─────────── wait(after_shared) ── add
    side:        wait(before) ── shared experts ── record(after_shared)

The input is produced on the main stream, hence the side stream waits for `before`; the main stream waits
for `after_shared` before it reads the shared output, and `record_stream` tells the caching allocator the
input is in use on the side stream. Streams and events come from the platform: on the CPU they are no-ops,
so enabling the flag there runs the same operations in the same order and changes nothing numerically.
"""
from __future__ import annotations

from typing import Callable

import torch

from pagedserve.platforms import current_platform


class SharedExpertOverlap:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.platform = current_platform()
        self.side_stream = self.platform.new_stream() if enabled else None

    def run(self, hidden_states: torch.Tensor, shared: Callable[[torch.Tensor], torch.Tensor],
            routed: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(shared(hidden_states), routed(hidden_states)), overlapped when enabled on a device."""
        if not self.enabled or self.side_stream is None:
            return shared(hidden_states), routed(hidden_states)
        platform = self.platform
        before = platform.new_event()
        before.record(platform.current_stream())
        with platform.stream(self.side_stream):
            platform.wait_event(self.side_stream, before)
            platform.record_stream(hidden_states, self.side_stream)
            shared_output = shared(hidden_states)
            after_shared = platform.new_event()
            after_shared.record(self.side_stream)
        routed_output = routed(hidden_states)
        platform.wait_event(None, after_shared)
        platform.record_stream(shared_output, platform.current_stream())
        return shared_output, routed_output
