"""MultiConnector: several KV connectors as one (vLLM's name), e.g. PD plus a KV pool.

Loads: the first connector (in config order) that offers external tokens for a request provides them; the others
see no external tokens for it. Finishing: the request's blocks are kept when any part keeps them. A request is kept
by at most one part (one producer per engine, one loader per request), so the union of the parts' step reports
frees it exactly when that part is done.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedserve.core.scheduler_output import KVConnectorOutput
from pagedserve.kv_transfer.connector_base import KVConnectorScheduler, KVConnectorWorker

if TYPE_CHECKING:
    import torch

    from pagedserve.attention.kv_page_layout import KVPageLayout
    from pagedserve.core.request import Request
    from pagedserve.core.scheduler_output import SchedulerOutput


class MultiConnectorScheduler(KVConnectorScheduler):
    def __init__(self, parts: list[KVConnectorScheduler]) -> None:
        self.parts = parts
        # request id -> index of the part that provides its external tokens.
        self._provider: dict[str, int] = {}
        # request id -> index of the part that loads its external tokens (until it finishes).
        self._loader: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        for index, part in enumerate(self.parts):
            num_tokens, is_async = part.get_num_new_matched_tokens(request, num_computed_tokens)
            if num_tokens > 0:
                self._provider[request.request_id] = index
                return num_tokens, is_async
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        provider = self._provider.pop(request.request_id, None)
        if provider is not None and num_external_tokens > 0:
            self._loader[request.request_id] = provider
        for index, part in enumerate(self.parts):
            part.update_state_after_alloc(request, block_ids, num_external_tokens if index == provider else 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> list[Any]:
        return [part.build_connector_meta(scheduler_output) for part in self.parts]

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for part in self.parts:
            part.update_connector_output(connector_output)

    def recomputes_failed_loads(self, request_id: str) -> bool:
        loader = self._loader.get(request_id)
        return loader is not None and self.parts[loader].recomputes_failed_loads(request_id)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._provider.pop(request.request_id, None)
        self._loader.pop(request.request_id, None)
        is_delayed, merged = False, None
        for part in self.parts:
            delay, params = part.request_finished(request, block_ids)
            is_delayed = is_delayed or delay
            if params is not None:
                merged = (merged or {}) | params
        return is_delayed, merged

    def shutdown(self) -> None:
        for part in self.parts:
            part.shutdown()


class MultiConnectorWorker(KVConnectorWorker):
    def __init__(self, parts: list[KVConnectorWorker]) -> None:
        self.parts = parts

    @property
    def port(self) -> int:
        return max((part.port for part in self.parts), default=0)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], page_layouts: dict[str, KVPageLayout],
                           num_blocks: int) -> None:
        for part in self.parts:
            part.register_kv_caches(kv_caches, page_layouts, num_blocks)

    def start_load_kv(self, metadata: Any) -> None:
        for part, part_metadata in zip(self.parts, metadata, strict=True):
            part.start_load_kv(part_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for part in self.parts:
            part.wait_for_layer_load(layer_name)

    @property
    def saves_kv_per_layer(self) -> bool:
        return any(part.saves_kv_per_layer for part in self.parts)

    def save_kv_layer(self, layer_name: str, kv_cache: torch.Tensor) -> None:
        for part in self.parts:
            part.save_kv_layer(layer_name, kv_cache)

    def wait_for_save(self) -> None:
        for part in self.parts:
            part.wait_for_save()

    def get_finished(self, finished_request_ids: set[str]) -> KVConnectorOutput:
        merged = KVConnectorOutput()
        for part in self.parts:
            output = part.get_finished(finished_request_ids)
            merged.finished_sending |= output.finished_sending
            merged.finished_recving |= output.finished_recving
            merged.invalid_block_ids |= output.invalid_block_ids
        return merged

    def shutdown(self) -> None:
        for part in self.parts:
            part.shutdown()
