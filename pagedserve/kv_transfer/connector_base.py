"""The KV connector seam, split as vLLM v1 splits it: a scheduler side and a worker side.

Scheduler side (pure Python, in the engine core):
- get_num_new_matched_tokens(request, num_computed_tokens) -> (tokens whose KV comes from elsewhere, is it async):
  asked when a waiting request is admitted, after the local prefix cache lookup;
- update_state_after_alloc(request, block_ids, num_external_tokens): the blocks the external KV goes into;
- build_connector_meta(scheduler_output): the worker side's orders for this step (SchedulerOutput field);
- update_connector_output(connector_output): the worker side's report of a step;
- request_finished(request, block_ids) -> (delay the free?, kv_transfer_params to return).
An async load parks the request in WAITING_FOR_REMOTE_KVS with its blocks until the worker reports it loaded.

Worker side (next to the KV caches):
- register_kv_caches(kv_caches, page_layouts, num_blocks): {layer name: cache} once, after allocation;
- start_load_kv(metadata) before the forward, wait_for_layer_load(layer_name) / save_kv_layer(layer_name) inside
  it (layer-wise connectors), wait_for_save() after it;
- get_finished(finished_request_ids) -> KVConnectorOutput: loads and sends that ended since the last step.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pagedserve.attention.kv_page_layout import KVPageLayout
    from pagedserve.core.request import Request
    from pagedserve.core.scheduler_output import KVConnectorOutput, SchedulerOutput


class KVConnectorScheduler(ABC):
    """The scheduler side of a KV connector."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past `num_computed_tokens` (local prefix hit) whose KV this connector provides, and whether it
        arrives asynchronously (then the request waits in WAITING_FOR_REMOTE_KVS)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The request's whole block table after allocation for its external tokens (0: nothing to load)."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        """The worker side's orders for this step; resets the per-step state."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The worker side's report of a step, before the scheduler acts on it."""
        return None

    def recomputes_failed_loads(self, request_id: str) -> bool:
        """True when blocks of the request that did not arrive are always recomputed, whatever
        kv_load_failure_policy says (a cache such as a KV pool: a miss is no error)."""
        return False

    @abstractmethod
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A request finished (any reason): True to keep its blocks until the worker reports it in
        finished_sending or finished_recving, and kv_transfer_params for its output (or None)."""

    def shutdown(self) -> None:
        return None


class KVConnectorWorker(ABC):
    """The worker side of a KV connector."""

    @abstractmethod
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], page_layouts: dict[str, KVPageLayout],
                           num_blocks: int) -> None:
        """Every attention layer's cache (allocated primary view, its components attached) and page layout, by
        layer name; each holds `num_blocks` blocks."""

    @property
    def port(self) -> int:
        """The port this worker serves its blocks on (0: none)."""
        return 0

    @abstractmethod
    def start_load_kv(self, metadata: Any) -> None:
        """Take this step's orders (before the forward): start loads, note blocks to serve or drop."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise loading: block until `layer_name`'s KV is in place (a no-op for whole-request loads)."""
        return None

    @property
    def saves_kv_per_layer(self) -> bool:
        """True when save_kv_layer does something: the model runner then calls it from every attention layer's
        forward (attention/forward_context.py); False spares the forward the calls."""
        return False

    def save_kv_layer(self, layer_name: str, kv_cache: torch.Tensor) -> None:
        """Layer-wise saving: `layer_name`'s KV of this step is written (a no-op for pull connectors)."""
        return None

    @abstractmethod
    def wait_for_save(self) -> None:
        """After the forward: everything this step must make available to other engines is available."""

    @abstractmethod
    def get_finished(self, finished_request_ids: set[str]) -> KVConnectorOutput:
        """Loads and sends that ended since the last call; `finished_request_ids` finished in the scheduler (a
        load still running for one of them is cancelled)."""

    def shutdown(self) -> None:
        return None
