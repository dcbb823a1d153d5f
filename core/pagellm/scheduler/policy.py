"""The scheduling-policy contract: the order in which waiting requests are admitted, and which
running request is preempted when the KV cache runs short. Policies are plugins of
``pagellm.scheduler_policies`` (the built-in ``fcfs`` and ``priority`` too); ``--scheduling-policy``
names one, and each scheduler builds its own instance, with no arguments.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from typing import Any

from pagellm.plugins.groups import SCHEDULER_POLICY
from pagellm.plugins.registry import Registry
from pagellm.request import Request


class SchedulingPolicy:
    """Holds the waiting requests: the scheduler adds them, admits them in the policy's order
    (`peek`, then `pop` once the request fits) and removes aborted ones. This base class is first
    come, first served; a policy overrides what it does differently."""

    orders_by_priority: bool = False
    """Whether the policy reads `Request.priority`; a request of another priority than 0 is
    refused (naming ``priority``) under a policy that does not, rather than ignored."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        """A new request."""
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        """A preempted request back in the queue: it was admitted before every waiting one."""
        self._queue.appendleft(request)

    def peek(self) -> Request:
        """The request to admit next (asked only when some request waits)."""
        return self._queue[0]

    def pop(self) -> Request:
        """Remove and return the request `peek` returns."""
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        """Remove a waiting request (aborted)."""
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        """The waiting requests, in admission order."""
        return iter(self._queue)

    def pick_victim(self, running: list[Request]) -> Request:
        """The request to preempt among ``running`` (never empty, in admission order)."""
        return running[-1]


class KeyOrderedPolicy(SchedulingPolicy, ABC):
    """Admits waiting requests by ascending `key` (equal keys: by request id), and preempts the
    running request with the largest key. A policy of this kind is its `key` alone."""

    def __init__(self) -> None:
        self._heap: list[tuple[Any, str, Request]] = []

    @abstractmethod
    def key(self, request: Request) -> Any:
        """A sortable value: smaller is admitted sooner and preempted later."""

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (self.key(request), request.request_id, request))

    def prepend(self, request: Request) -> None:
        self.add(request)  # the order comes from the key alone

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[2] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[2] for entry in sorted(self._heap))

    def pick_victim(self, running: list[Request]) -> Request:
        return max(running, key=self.key)


scheduling_policies: Registry[SchedulingPolicy] = Registry(
    "Scheduling policy", SchedulingPolicy, SCHEDULER_POLICY
)
