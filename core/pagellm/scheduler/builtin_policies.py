"""The built-in scheduling policies, registered like any plugin's: pagellm's own distribution
declares this module in the ``pagellm.scheduler_policies`` entry-point group."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from pagellm.plugins import hookimpl
from pagellm.request import Request
from pagellm.scheduler.policy import KeyOrderedPolicy, SchedulingPolicy

pagellm_plugin_api = "1.1"


class FCFSPolicy(SchedulingPolicy):
    """First come, first served; a preempted request goes back to the front."""

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

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityPolicy(KeyOrderedPolicy):
    """Lower ``priority`` value first, then earlier arrival."""

    def key(self, request: Request) -> tuple[int, float]:
        return (request.priority, request.arrival_time)


@hookimpl
def pagellm_scheduler_policies() -> dict[str, str]:
    return {"fcfs": f"{__name__}:FCFSPolicy", "priority": f"{__name__}:PriorityPolicy"}
