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
from pagedserve.core.prefill_chunk_policy import PrefillChunkPolicy
from pagedserve.core.profiling_chunk_predictor import LatencySample, build_profiling_chunk_policy
from pagedserve.core.scheduler import Scheduler
from pagedserve.executor.abstract import Executor, FatalExecutorError

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
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager, cache_config.block_size,
                                   prefill_chunk_policy=self._prefill_chunk_policy())

    def _prefill_chunk_policy(self) -> PrefillChunkPolicy | None:
        """The profiling-tuned chunk policy when enabled and the worker sent its timings, else None."""
        profiling = self.config.profiling_chunk_config
        if not profiling.enable:
            return None
        samples = [LatencySample(*sample) for sample in getattr(self.runtime_info, "chunk_latency_samples", ())]
        if not samples:
            logger.warning("profiling_chunk_config is enabled but the executor returned no chunk timings; "
                           "prefill chunks keep their default sizes")
            return None
        policy = build_profiling_chunk_policy(
            samples, profiling.target_tpot_ms, self.config.cache_config.block_size,
            self.config.scheduler_config.max_num_batched_tokens, profiling.min_chunk, profiling.smoothing)
        model = policy.model
        logger.info("profiling-tuned chunks: step latency %.2f ms + %.4f ms/token + %.3g ms/token^2 + "
                    "%.3g ms/(token x history token); step budget %.1f ms",
                    model.intercept * 1e3, model.linear * 1e3, model.quadratic * 1e3, model.history * 1e3,
                    policy.step_budget_seconds * 1e3)
        return policy

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def make_stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        imbalance = getattr(self, "_eplb_imbalance", None)
        if imbalance is not None:
            stats.eplb_num_rebalances = self._eplb_num_rebalances
            stats.eplb_imbalance_before = [before for before, _ in imbalance]
            stats.eplb_imbalance_after = [after for _, after in imbalance]
        return stats

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        try:
            model_output = self.executor.execute_model(scheduler_output)
        except FatalExecutorError:
            raise  # the workers are gone: no later step can run
        except Exception:
            logger.exception("model step failed; failing the %d requests of this batch",
                             len(scheduler_output.num_scheduled_tokens))
            return self._fail_batch(scheduler_output.num_scheduled_tokens)
        if model_output.eplb_imbalance is not None:
            self._record_eplb(model_output.eplb_imbalance)
        return self.scheduler.update_from_output(scheduler_output, model_output)

    def _record_eplb(self, imbalance: list[tuple[float, float]]) -> None:
        """Keep the latest EPLB rebalance's per-layer imbalance for the stats (and /metrics)."""
        self._eplb_num_rebalances = getattr(self, "_eplb_num_rebalances", 0) + 1
        self._eplb_imbalance = imbalance

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
