"""DataParallelEngineCore: data_parallel_size engine cores behind the EngineCore interface.

Each DP rank is a full EngineCore (its own scheduler, KV cache manager and executor — 'mp' or 'ray'
when it is itself tensor/pipeline parallel). New requests go to the DPCoordinator's choice; a request
no rank may take now waits here and is offered again each step. Steps run the ranks one after the
other in this process (dense models need no cross-rank collective; MoE expert parallelism across DP
ranks would need lock-stepped ranks with dummy batches, which this does not build).
With a KV connector every rank is its own P or D engine (EngineConfig.for_data_parallel_rank): a P rank serves
the blocks of the requests it ran and names itself in their kv_transfer_params; a D rank pulls the requests the
coordinator gave it. A push-mode producer's request goes to the rank its id names instead
(kv_transfer/push_producer_rank.py: D's push order names that rank before P has the request); held requests whose
rank may not take one yet wait while later ones go ahead.
"""
from __future__ import annotations

from collections import deque

from pagedserve.config.engine import EngineConfig
from pagedserve.core.engine_core_output import EngineCoreOutput, SchedulerStats
from pagedserve.core.request import Request, RequestStatus
from pagedserve.distributed.dp_coordinator import DPCoordinator, RankLoad
from pagedserve.engine.engine_core import EngineCore
from pagedserve.kv_transfer.push_producer_rank import push_producer_rank


class DataParallelEngineCore:
    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel_config
        self.config = config
        self.cores: list[EngineCore] = []
        try:
            for rank in range(parallel.data_parallel_size):
                # A KV connector per rank, with the rank's own engine id and ports (a P rank's kv_transfer_params
                # name it, so D pulls from the rank that holds the blocks).
                self.cores.append(EngineCore(config.for_data_parallel_rank(rank)))
        except BaseException:
            self.shutdown()
            raise
        self.runtime_info = self.cores[0].runtime_info
        self.coordinator = DPCoordinator(parallel.data_parallel_size, config.scheduler_config.max_num_seqs,
                                         parallel.enable_balance_scheduling, parallel.dyntra_lb_config)
        # A push-mode producer runs each request on the rank its id names (kv_transfer/push_producer_rank.py): D's
        # push order reaches that rank before the request does.
        self.is_routed_by_request_id = _is_push_producer(config)
        self.held: deque[Request] = deque()
        self.owner: dict[str, int] = {}
        self.tokens_served_per_rank = [0] * parallel.data_parallel_size
        self.requests_routed_per_rank = [0] * parallel.data_parallel_size

    def rank_loads(self) -> list[RankLoad]:
        loads = []
        for core in self.cores:
            scheduler = core.scheduler
            manager = core.kv_cache_manager
            loads.append(RankLoad(num_waiting=len(scheduler.waiting), num_running=len(scheduler.running),
                                  num_kv_blocks_used=round(manager.usage * (core.runtime_info.num_kv_blocks - 1))))
        return loads

    def add_request(self, request: Request) -> None:
        self.held.append(request)
        self._dispatch()

    def _dispatch(self) -> None:
        while self.held:
            if self.is_routed_by_request_id:
                taken = self._next_by_request_id()
                if taken is None:
                    return
                request, rank = taken
            else:
                rank = self.coordinator.choose_rank(self.rank_loads())
                if rank is None:
                    return
                request = self.held.popleft()
            self.owner[request.request_id] = rank
            self.requests_routed_per_rank[rank] += 1
            self.cores[rank].add_request(request)

    def _next_by_request_id(self) -> tuple[Request, int] | None:
        """The first held request whose own rank (push_producer_rank) may take a request now, taken off the queue
        with that rank; None when no held request's rank may."""
        admissible = set(self.coordinator.admissible_ranks(self.rank_loads()))
        for index, request in enumerate(self.held):
            rank = push_producer_rank(request.request_id, len(self.cores))
            if rank in admissible:
                del self.held[index]
                return request, rank
        return None

    def abort_requests(self, request_ids: list[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        doomed = set(request_ids)
        self.held = deque(r for r in self.held if r.request_id not in doomed)
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self.owner.pop(request_id, None)
            if rank is not None:
                by_rank.setdefault(rank, []).append(request_id)
        for rank, ids in by_rank.items():
            self.cores[rank].abort_requests(ids, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.held) or any(core.has_unfinished_requests() for core in self.cores)

    def reset_prefix_cache(self) -> bool:
        """Every rank's prefix cache; True only when all of them were reset."""
        return all([core.reset_prefix_cache() for core in self.cores])

    def step(self) -> list[EngineCoreOutput]:
        self._dispatch()
        outputs: list[EngineCoreOutput] = []
        for rank, core in enumerate(self.cores):
            rank_outputs = core.step()
            for output in rank_outputs:
                self.tokens_served_per_rank[rank] += len(output.new_token_ids)
                if output.finished:
                    self.owner.pop(output.request_id, None)
            outputs.extend(rank_outputs)
        return outputs

    def make_stats_per_rank(self) -> list[SchedulerStats]:
        return [core.make_stats() for core in self.cores]

    def make_stats(self) -> SchedulerStats:
        """All ranks together (held requests count as waiting; KV usage is the mean)."""
        per_rank = self.make_stats_per_rank()
        return SchedulerStats(
            num_running_requests=sum(s.num_running_requests for s in per_rank),
            num_waiting_requests=sum(s.num_waiting_requests for s in per_rank) + len(self.held),
            kv_cache_usage=sum(s.kv_cache_usage for s in per_rank) / len(per_rank),
            prefix_cache_queries=sum(s.prefix_cache_queries for s in per_rank),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in per_rank),
            external_prefix_cache_queries=sum(s.external_prefix_cache_queries for s in per_rank),
            external_prefix_cache_hits=sum(s.external_prefix_cache_hits for s in per_rank),
            num_preemptions=sum(s.num_preemptions for s in per_rank),
            spec_decode_num_drafts=sum(s.spec_decode_num_drafts for s in per_rank),
            spec_decode_num_draft_tokens=sum(s.spec_decode_num_draft_tokens for s in per_rank),
            spec_decode_num_accepted_tokens=sum(s.spec_decode_num_accepted_tokens for s in per_rank),
            spec_decode_num_accepted_tokens_per_pos=_sum_columns(
                [s.spec_decode_num_accepted_tokens_per_pos for s in per_rank]),
        )

    def shutdown(self) -> None:
        for core in self.cores:
            core.shutdown()


def _sum_columns(rows: list[list[int]]) -> list[int]:
    """Element-wise sum of lists of different lengths (missing entries count 0)."""
    total = [0] * max((len(row) for row in rows), default=0)
    for row in rows:
        for position, value in enumerate(row):
            total[position] += value
    return total


def _is_push_producer(config: EngineConfig) -> bool:
    """Whether the engine's PD connector is a producer in push mode (its DP ranks are chosen by request id)."""
    from pagedserve.kv_transfer.kv_transfer_info import pd_connector_config

    part = pd_connector_config(config.kv_transfer_config)
    return part is not None and part.is_producer and part.extra("mode") == "push"


def create_engine_core(config: EngineConfig) -> EngineCore | DataParallelEngineCore:
    """One EngineCore, or one per DP rank behind a coordinator when data_parallel_size > 1."""
    if config.parallel_config.data_parallel_size > 1:
        return DataParallelEngineCore(config)
    return EngineCore(config)
