"""Pipeline-parallel communication: the activations one stage hands the next.

A stage that is not the last ends its forward with `IntermediateTensors` (the hidden states and the
residual stream after its last decoder layer); the next stage of the same PP group (same TP index)
receives them and continues. Every stage builds the same flat step inputs from an identical persistent
batch, so the receiver knows the shape without a header: [num_tokens, hidden_size] in the model dtype.

Both tensors travel as one [2, num_tokens, hidden_size] message (one point-to-point operation per step
instead of two: per-message latency dominates small decode batches). The send is asynchronous (isend):
the sending stage goes on to its next micro-batch while the next stage is still busy; the tensor is kept
alive until its send completes.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed

from pagedserve.distributed.parallel_state import GroupCoordinator, get_pp_group

# Sends not yet known to be complete, beyond which the oldest is waited for (bounds the buffers kept
# alive; the engine never has more micro-batches in flight than there are stages).
MAX_PENDING_SENDS = 8


@dataclass
class IntermediateTensors:
    """What crosses a stage boundary: the hidden states and the residual, both [num_tokens, hidden_size]."""

    hidden_states: torch.Tensor
    residual: torch.Tensor


class PipelineCommunicator:
    """Point-to-point transfer of IntermediateTensors between neighbouring stages of one PP group."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 group: GroupCoordinator | None = None) -> None:
        self.group = group if group is not None else get_pp_group()
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self._pending_sends: deque[tuple[torch.distributed.Work, torch.Tensor]] = deque()

    @property
    def is_first_stage(self) -> bool:
        return self.group.is_first_rank

    @property
    def is_last_stage(self) -> bool:
        return self.group.is_last_rank

    def send(self, tensors: IntermediateTensors) -> None:
        """Hand `tensors` to the next stage without waiting for it to receive them."""
        if self.is_last_stage:
            raise RuntimeError("the last pipeline stage has no next stage to send to")
        message = torch.stack((tensors.hidden_states, tensors.residual)).contiguous()
        destination = self.group.ranks[self.group.rank + 1]
        work = torch.distributed.isend(message, dst=destination, group=self.group.process_group)
        self._pending_sends.append((work, message))
        self._reap_sends()

    def recv(self, num_tokens: int) -> IntermediateTensors:
        """Block until the previous stage's activations for this step (num_tokens rows) arrive."""
        if self.is_first_stage:
            raise RuntimeError("the first pipeline stage has no previous stage to receive from")
        message = torch.empty((2, num_tokens, self.hidden_size), dtype=self.dtype, device=self.device)
        source = self.group.ranks[self.group.rank - 1]
        torch.distributed.recv(message, src=source, group=self.group.process_group)
        return IntermediateTensors(hidden_states=message[0], residual=message[1])

    def _reap_sends(self) -> None:
        """Drop completed sends; wait for the oldest ones while too many are outstanding."""
        while self._pending_sends and (len(self._pending_sends) > MAX_PENDING_SENDS
                                       or self._pending_sends[0][0].is_completed()):
            work, _ = self._pending_sends.popleft()
            work.wait()

    def wait_for_sends(self) -> None:
        """Block until every send has completed (the receiver took it)."""
        while self._pending_sends:
            work, _ = self._pending_sends.popleft()
            work.wait()

    @property
    def num_pending_sends(self) -> int:
        return len(self._pending_sends)
