"""EngineCore: the step loop — schedule, execute, update — over one executor.

One failing step never takes the engine down: the requests of that batch finish with
finish_reason='error' and the next step runs normally. Their computed-token counts are rolled back
first, so the blocks the failed step was writing (which may hold partial KV) leave the prefix cache.
"""
from __future__ import annotations

import logging

from pagedserve.config.engine import EngineConfig
from pagedserve.core.engine_core_output import EngineCoreOutput, SchedulerStats
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.scheduler import Scheduler
from pagedserve.executor.abstract import Executor

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.config = config
        self.executor = executor or Executor.create(config)
        self.runtime_info = self.executor.runtime_info
        cache_config = config.cache_config
        self.kv_cache_manager = KVCacheManager(
            num_blocks=self.runtime_info.num_kv_blocks,
            block_size=cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager, cache_config.block_size)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        try:
            model_output = self.executor.execute_model(scheduler_output)
        except Exception:
            logger.exception("model step failed; failing the %d requests of this batch",
                             len(scheduler_output.num_scheduled_tokens))
            return self._fail_batch(scheduler_output.num_scheduled_tokens)
        return self.scheduler.update_from_output(scheduler_output, model_output)

    def _fail_batch(self, num_scheduled_tokens: dict[str, int]) -> list[EngineCoreOutput]:
        for request_id, num_tokens in num_scheduled_tokens.items():
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                # The KV manager only uncaches blocks past num_computed_tokens.
                request.num_computed_tokens -= num_tokens
        request_ids = list(num_scheduled_tokens)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ERROR)
        return [EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason="error")
                for rid in request_ids]

    def shutdown(self) -> None:
        self.executor.shutdown()
