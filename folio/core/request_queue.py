"""Waiting queues and preemption-victim choice, one strategy object per scheduling policy.

FCFS: arrival order; a preempted request goes back to the FRONT (it arrived before everyone still waiting), and
the victim is the last running request (the latest admitted).
Priority: lower ``priority`` value first, then earlier arrival; a preempted request simply re-enters in that
order, and the victim is the running request with the largest (priority, arrival_time).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Protocol

from folio.request import Request


class RequestQueue(Protocol):
    """What the scheduler needs from a waiting queue."""

    def add(self, request: Request) -> None:
        """Enqueue a new (or fallen-back fork) request in policy order."""

    def prepend(self, request: Request) -> None:
        """Re-enqueue a preempted request: ahead of requests that arrived after it."""

    def peek(self) -> Request:
        """The next request to schedule; IndexError when empty."""

    def pop(self) -> Request:
        """Remove and return ``peek()``."""

    def remove(self, request: Request) -> None:
        """Remove a request from anywhere (abort); ValueError if absent."""

    def select_victim(self, running: Sequence[Request]) -> Request:
        """The running request to preempt when blocks run out."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]:
        """In scheduling order."""


class FCFSRequestQueue:
    """First come, first served: a deque in arrival order."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def select_victim(self, running: Sequence[Request]) -> Request:
        return running[-1]

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """Min-heap on (priority, arrival_time, insertion counter); the counter keeps ties stable and Requests
    uncompared. Removal from the middle rebuilds the heap: O(n), fine for aborts."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._counter), request))

    def prepend(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        for index, entry in enumerate(self._heap):
            if entry[3] is request:
                self._heap.pop(index)
                heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.request_id} is not waiting")

    def select_victim(self, running: Sequence[Request]) -> Request:
        # Among equals, the later one in running (admitted later) is preempted.
        return max(reversed(running), key=lambda request: (request.priority, request.arrival_time))

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda entry: entry[:3]))


def create_request_queue(policy: str) -> RequestQueue:
    """The waiting queue for a ``SchedulerConfig.policy``."""
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}")
