"""EngineCore: the step loop — schedule, execute, update — over one executor.

One failing step never takes the engine down: the requests of that batch finish with
finish_reason='error' and the next step runs normally. Their computed-token counts are rolled back
first, so the blocks the failed step was writing (which may hold partial KV) leave the prefix cache.

With `max_concurrent_batches` > 1 (async scheduling) `step()` runs `step_with_batch_queue()`: it
schedules and submits steps while the batch queue has room, then waits for the oldest one and returns
its outputs, so the next step is already queued on the worker when the current one ends.
"""
from __future__ import annotations

import logging
import time

from pagedserve.config.engine import EngineConfig
from pagedserve.core.engine_core_output import EngineCoreOutput, SchedulerStats
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.prefill_chunk_policy import PrefillChunkPolicy
from pagedserve.core.profiling_chunk_predictor import LatencySample, build_profiling_chunk_policy
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.core.sparse_kv_offload_stats import SparseKVOffloadStats
from pagedserve.engine.batch_queue import BatchQueue, InFlightStep
from pagedserve.executor.abstract import Executor, FatalExecutorError
from pagedserve.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# An empty synchronous step (requests only wait for a KV connector: a remote load, a consumer's done notice) sleeps
# this long, so that the loop polling the connector leaves the CPU to the threads moving the KV.
IDLE_STEP_SLEEP_S = 0.001


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.config = config
        self.executor = executor or Executor.create(config)
        self.runtime_info = self.executor.runtime_info
        cache_config = config.cache_config
        self.kv_cache_manager = KVCacheManager(
            num_blocks=self.runtime_info.num_kv_blocks,
            block_size=config.tokens_per_block,
            enable_caching=cache_config.enable_prefix_caching,
        )
        # The KV connector's scheduler side (kv_transfer/); None without kv_transfer_config.
        kv_connector = None
        kv_transfer_config = config.kv_transfer_config
        if kv_transfer_config is not None:
            from pagedserve.kv_transfer.connector_factory import create_scheduler_connector, kv_engine_signature

            kv_connector = create_scheduler_connector(kv_transfer_config, config.tokens_per_block,
                                                      list(self.runtime_info.kv_transfer_ports)
                                                      or [self.runtime_info.kv_transfer_port],
                                                      kv_engine_signature(config))
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager, config.tokens_per_block,
                                   prefill_chunk_policy=self._prefill_chunk_policy(),
                                   # Pipeline stages before the last learn the sampled tokens from the deltas.
                                   include_new_token_ids=config.parallel_config.pipeline_parallel_size > 1,
                                   num_lookahead_tokens=config.speculative_config.num_lookahead_tokens,
                                   kv_connector=kv_connector,
                                   kv_load_failure_policy=kv_transfer_config.kv_load_failure_policy
                                   if kv_transfer_config is not None else "recompute",
                                   structured_output_manager=StructuredOutputManager.from_engine_config(config))
        # Steps in flight (async scheduling, pipeline micro-batches); None: one step at a time.
        max_concurrent_batches = self.executor.max_concurrent_batches
        self.batch_queue = (BatchQueue(max_concurrent_batches, self.kv_cache_manager)
                            if max_concurrent_batches > 1 else None)
        # Set once the executor failed fatally with steps in flight: every later step raises it again.
        self._fatal_error: FatalExecutorError | None = None
        # Workers learn of finished requests with the next step. With sparse KV offload they hold per-request
        # resident buffers, so when the engine goes idle an empty step tells them at once.
        self._notify_finished_when_idle = config.sparse_kv_offload_config is not None
        # The workers' latest sparse KV offload counters (None without offload), reported in make_stats.
        self._sparse_kv_offload_stats: SparseKVOffloadStats | None = None

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
            samples, profiling.target_tpot_ms, self.config.tokens_per_block,
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
        self._notify_finished_if_idle()

    def _notify_finished_if_idle(self) -> None:
        """With nothing left to run, send the workers the finished ids in an empty step (see __init__)."""
        if self._notify_finished_when_idle and self._fatal_error is None and self.scheduler.finished_request_ids \
                and not self.batch_queue and not self.scheduler.has_unfinished_requests():
            model_output = self.executor.execute_model(self.scheduler.schedule())
            if model_output.sparse_kv_offload_stats is not None:
                self._sparse_kv_offload_stats = model_output.sparse_kv_offload_stats

    def has_unfinished_requests(self) -> bool:
        """Requests waiting or running, steps still in flight (their outputs must be collected), or finished
        requests whose blocks the KV connector still holds (steps release them)."""
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue) \
            or self.scheduler.has_kv_held_requests()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's reset_prefix_cache); False, and nothing changes, while a
        request is waiting or running. Steps still in flight with no request left (async scheduling runs one
        step ahead, so the last requests can finish with the next step already queued) are completed first:
        their outputs belong to finished requests and are dropped."""
        if self.scheduler.has_unfinished_requests():
            return False
        while self.batch_queue:
            self.step()
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        imbalance = getattr(self, "_eplb_imbalance", None)
        if imbalance is not None:
            stats.eplb_num_rebalances = self._eplb_num_rebalances
            stats.eplb_imbalance_before = [before for before, _ in imbalance]
            stats.eplb_imbalance_after = [after for _, after in imbalance]
        stats.sparse_kv_offload = self._sparse_kv_offload_stats
        return stats

    def step(self) -> list[EngineCoreOutput]:
        """One engine iteration: the outputs of one finished model step (none when idle)."""
        if self.batch_queue is not None:
            return self.step_with_batch_queue()
        if not self.scheduler.has_unfinished_requests() and not self.scheduler.has_kv_held_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        try:
            model_output = self.executor.execute_model(scheduler_output)
        except FatalExecutorError:
            raise  # the workers are gone: no later step can run
        except Exception:
            logger.exception("model step failed; failing the %d requests of this batch",
                             len(scheduler_output.num_scheduled_tokens))
            return self._fail_batch(scheduler_output)
        outputs = self._update_from_output(scheduler_output, model_output)
        self._notify_finished_if_idle()
        if scheduler_output.is_empty and not outputs:
            time.sleep(IDLE_STEP_SLEEP_S)
        return outputs

    def step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """Fill the batch queue, then collect the oldest step in flight.

        While the queue has room and there is work, schedule and submit (step t+1 is scheduled while
        step t runs). An empty schedule is submitted only when it carries finished or preempted ids for
        the workers, and stops the filling. Then wait for the oldest step and apply its outputs.
        """
        queue = self.batch_queue
        assert queue is not None
        fatal_error = self._fatal_error
        if fatal_error is not None:
            # Without async scheduling a request whose step died in flight has nothing left to schedule:
            # without this the engine would idle forever instead of failing.
            raise FatalExecutorError(f"the executor failed in an earlier step: {fatal_error}")
        while not queue.is_full and (self.scheduler.has_unfinished_requests()
                                     or self.scheduler.has_kv_held_requests()):
            scheduler_output = self.scheduler.schedule()
            has_notices = bool(scheduler_output.finished_request_ids or scheduler_output.preempted_request_ids)
            # A KV connector's news (a load ended, a consumer is done) comes back with a step: with nothing else in
            # flight an empty one is sent for it (pipeline parallel runs the batch queue).
            polls_kv_connector = self.scheduler.kv_connector is not None and not queue
            if not scheduler_output.is_empty or has_notices or polls_kv_connector:
                queue.submit(scheduler_output, self.executor.execute_model_async(scheduler_output),
                             self.scheduler.requests)
            if scheduler_output.is_empty:
                break  # nothing more to run until an output comes back
        if not queue:
            return []
        step = queue.pop_oldest()
        try:
            model_output = step.future.result()
        except FatalExecutorError as error:
            self._fatal_error = error
            raise
        except Exception:
            logger.exception("model step failed; failing the %d requests of this batch",
                             len(step.scheduler_output.num_scheduled_tokens))
            return self._fail_batch(step.scheduler_output, step)
        outputs = self._update_from_output(step.scheduler_output, model_output)
        self._notify_finished_if_idle()
        if step.scheduler_output.is_empty and not outputs:
            time.sleep(IDLE_STEP_SLEEP_S)
        return outputs

    def _update_from_output(self, scheduler_output: SchedulerOutput,
                            model_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        if model_output.eplb_imbalance is not None:
            self._record_eplb(model_output.eplb_imbalance)
        if model_output.sparse_kv_offload_stats is not None:
            self._sparse_kv_offload_stats = model_output.sparse_kv_offload_stats
        return self.scheduler.update_from_output(scheduler_output, model_output)

    def _record_eplb(self, imbalance: list[tuple[float, float]]) -> None:
        """Keep the latest EPLB rebalance's per-layer imbalance for the stats (and /metrics)."""
        self._eplb_num_rebalances = getattr(self, "_eplb_num_rebalances", 0) + 1
        self._eplb_imbalance = imbalance

    def _fail_batch(self, scheduler_output: SchedulerOutput,
                    in_flight: InFlightStep | None = None) -> list[EngineCoreOutput]:
        """Finish the batch's requests with finish_reason='error'; roll their KV back.

        `in_flight` (the failed step of the batch queue) also fails the requests of later queued steps
        that read KV the failed step never wrote, and uncaches every block such KV sits in.
        """
        # Where the failed step's tokens started, per request (as sent to the worker).
        start_of_step = {new.request_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_requests}
        cached = scheduler_output.scheduled_cached_requests
        start_of_step.update(zip(cached.request_ids, cached.num_computed_tokens))
        request_ids = list(scheduler_output.num_scheduled_tokens)
        for request_id in request_ids:
            request = self.scheduler.requests.get(request_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                # The KV manager only uncaches blocks past num_computed_tokens.
                request.num_computed_tokens = start_of_step[request_id]
        poisoned_block_ids: set[int] = set()
        if in_flight is not None and self.batch_queue is not None:
            poisoned = self.batch_queue.poisoned_by(in_flight, self.kv_cache_manager.block_size)
            request_ids += poisoned.request_ids
            poisoned_block_ids = poisoned.block_ids
            if poisoned.request_ids:
                logger.error("failing %d requests of later steps too: they read KV the failed step never "
                             "wrote", len(poisoned.request_ids))
        live_ids = [rid for rid in request_ids if rid in self.scheduler.requests]
        self.scheduler.finish_requests(live_ids, RequestStatus.FINISHED_ERROR)
        self.kv_cache_manager.uncache_blocks(poisoned_block_ids)
        return [EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason="error") for rid in live_ids]

    def shutdown(self) -> None:
        if self.batch_queue is not None:
            self.batch_queue.clear()  # the executor's shutdown joins or cancels what is still running
        self.executor.shutdown()
        if self.scheduler.structured_output_manager is not None:
            self.scheduler.structured_output_manager.shutdown()
