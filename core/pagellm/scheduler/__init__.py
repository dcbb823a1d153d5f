from pagellm.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from pagellm.scheduler.scheduler import Scheduler

__all__ = ["CachedRequestData", "NewRequestData", "Scheduler", "SchedulerOutput"]
