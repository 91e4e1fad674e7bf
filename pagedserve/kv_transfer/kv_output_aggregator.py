"""KVOutputAggregator: one KVConnectorOutput per step from every worker rank's (vLLM v1's name and rule).

Each rank's connector worker side reports its own KV shard: a request is finished sending (P may free its blocks)
or finished receiving (D's load ended) only once every rank has reported it, possibly in different steps. A rank
reports a failed load's blocks (invalid_block_ids) in the same report as the request, and the scheduler reads them
only for the requests finished in the same output: a report's invalid ids are therefore passed on whenever one of its
requests is finished everywhere, until all of them are. (A rank's report seldom ends two loads at once; if it did,
and a block of the first, freed, were reused by a load finishing with the second, that load would be recomputed,
or failed under kv_load_failure_policy "fail", without need: never run on KV that did not arrive.) Pure Python.
"""
from __future__ import annotations

from pagedserve.core.scheduler_output import KVConnectorOutput


class KVOutputAggregator:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        # Request id -> ranks that have not reported it yet.
        self._sending_left: dict[str, int] = {}
        self._recving_left: dict[str, int] = {}
        # (requests of one rank's report, its invalid block ids), until each request is reported by every rank.
        self._invalid_reports: list[tuple[set[str], set[int]]] = []

    def aggregate(self, outputs: list[KVConnectorOutput | None]) -> KVConnectorOutput:
        """One step's reports (one per rank, None: nothing new) as one: the requests every rank has now reported."""
        merged = KVConnectorOutput()
        for output in outputs:
            if output is None:
                continue
            _count(output.finished_sending, self._sending_left, self.world_size, merged.finished_sending)
            _count(output.finished_recving, self._recving_left, self.world_size, merged.finished_recving)
            if output.invalid_block_ids:
                self._invalid_reports.append((set(output.finished_recving), set(output.invalid_block_ids)))
        if merged.finished_recving and self._invalid_reports:
            remaining = []
            for request_ids, block_ids in self._invalid_reports:
                if request_ids & merged.finished_recving:
                    merged.invalid_block_ids |= block_ids
                    request_ids -= merged.finished_recving
                if request_ids:
                    remaining.append((request_ids, block_ids))
            self._invalid_reports = remaining
        return merged


def _count(request_ids: set[str], left: dict[str, int], world_size: int, finished: set[str]) -> None:
    """Note one rank's report of `request_ids`; those now reported by every rank go into `finished`."""
    for request_id in request_ids:
        remaining = left.get(request_id, world_size) - 1
        if remaining <= 0:
            left.pop(request_id, None)
            finished.add(request_id)
        else:
            left[request_id] = remaining


__all__ = ["KVOutputAggregator"]
