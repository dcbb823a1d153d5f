"""The built-in scheduling policies, registered like any plugin's: pagellm's own distribution
declares this module in the ``pagellm.scheduler_policies`` entry-point group."""

from __future__ import annotations

from pagellm.plugins import hookimpl
from pagellm.request import Request
from pagellm.scheduler.policy import KeyOrderedPolicy, SchedulingPolicy

pagellm_plugin_api = "1.1"


class FCFSPolicy(SchedulingPolicy):
    """First come, first served (the base policy); a preempted request goes back to the front."""


class PriorityPolicy(KeyOrderedPolicy):
    """Lower ``priority`` value first, then earlier arrival."""

    orders_by_priority = True

    def key(self, request: Request) -> tuple[int, float]:
        return (request.priority, request.arrival_time)


@hookimpl
def pagellm_scheduler_policies() -> dict[str, str]:
    return {"fcfs": f"{__name__}:FCFSPolicy", "priority": f"{__name__}:PriorityPolicy"}
