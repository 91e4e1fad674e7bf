"""Waiting queues of the scheduler: first-come-first-served, or by (priority, arrival time)."""
from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from pagedserve.core.request import Request


class RequestQueue(ABC):
    """The requests waiting for admission (new ones and preempted ones)."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Enqueue a new request."""

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Re-enqueue a preempted request so that it is admitted before newer ones."""

    @abstractmethod
    def peek_request(self) -> Request:
        """The next request to admit (raises IndexError when empty)."""

    @abstractmethod
    def pop_request(self) -> Request:
        """Remove and return the next request to admit."""

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Remove the given requests (those not queued are ignored)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """The requests in admission order."""


class FCFSRequestQueue(RequestQueue):
    """Arrival order; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._requests: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._requests.append(request)

    def prepend_request(self, request: Request) -> None:
        self._requests.appendleft(request)

    def peek_request(self) -> Request:
        return self._requests[0]

    def pop_request(self) -> Request:
        return self._requests.popleft()

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = set(requests)
        self._requests = deque(request for request in self._requests if request not in to_remove)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)


class PriorityRequestQueue(RequestQueue):
    """A heap on (priority, arrival_time): lower priority values are admitted first.

    A preempted request keeps its priority and arrival time, so it simply returns to the heap.
    """

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def prepend_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek_request from an empty queue")
        return self._heap[0]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        to_remove = set(requests)
        self._heap = [request for request in self._heap if request not in to_remove]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


def create_request_queue(policy: str) -> RequestQueue:
    """The waiting queue for a scheduling policy ('fcfs' or 'priority')."""
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"scheduling policy={policy!r} must be one of ('fcfs', 'priority')")
