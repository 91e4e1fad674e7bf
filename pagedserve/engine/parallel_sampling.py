"""Parallel sampling (n > 1): fan one user request out into n child requests, and fan their outputs in.

The engine core only ever sees child requests, each with n=1. A child's id is f"{index}_{request_id}"
and its SamplingParams are the parent's with:
  - n = 1;
  - seed = parent seed + index when the parent is seeded, so the n samples differ from each other
    yet the whole set is reproducible;
  - prompt_logprobs only on child 0: the prompt is the same for all children, so computing its
    logprobs once is enough (and the other children stay free to use the prefix cache).
The user-facing RequestOutput carries the parent id and all n CompletionOutputs sorted by index.
"""
from __future__ import annotations

from pagedserve.outputs import CompletionOutput, PromptLogprobs
from pagedserve.sampling_params import SamplingParams


def child_request_id(index: int, request_id: str) -> str:
    """The engine-side id of child `index` of the parallel-sampling request `request_id`."""
    return f"{index}_{request_id}"


class ParentRequest:
    """Parent/child bookkeeping for one request with n > 1.

    Holds the latest CompletionOutput of each child (for cumulative and final-only outputs) and the
    set of children that have not finished yet; the parent is finished when every child is.
    """

    def __init__(self, request_id: str, sampling_params: SamplingParams) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.num_children = sampling_params.n
        self.child_request_ids: list[str] = [child_request_id(i, request_id) for i in range(self.num_children)]
        self._unfinished_child_ids: set[str] = set(self.child_request_ids)
        # index -> the child's latest cumulative CompletionOutput.
        self.latest_outputs: dict[int, CompletionOutput] = {}
        # The prompt's logprobs, computed by child 0 only.
        self.prompt_logprobs: PromptLogprobs | None = None

    def child_sampling_params(self, index: int) -> SamplingParams:
        """SamplingParams for child `index` (n=1, seed offset by index, prompt logprobs on child 0 only)."""
        if not 0 <= index < self.num_children:
            raise ValueError(f"index={index} must be in [0, {self.num_children})")
        params = self.sampling_params
        changes: dict[str, object] = {"n": 1}
        if params.seed is not None:
            changes["seed"] = params.seed + index
        if index > 0:
            changes["prompt_logprobs"] = None
        return params.clone(**changes)

    def record_output(self, index: int, output: CompletionOutput) -> None:
        self.latest_outputs[index] = output

    def mark_child_finished(self, child_id: str) -> None:
        self._unfinished_child_ids.discard(child_id)

    @property
    def unfinished_child_ids(self) -> list[str]:
        return [child for child in self.child_request_ids if child in self._unfinished_child_ids]

    @property
    def is_finished(self) -> bool:
        return not self._unfinished_child_ids

    def all_outputs(self) -> list[CompletionOutput]:
        """The latest output of every child seen so far, sorted by index."""
        return [self.latest_outputs[index] for index in sorted(self.latest_outputs)]
