"""The built-in stat loggers (a periodic log line here, and Prometheus metrics for ``/metrics``
in `pagellm.metrics.prometheus`) and `build_stat_loggers`, which adds the plugin ones named by the
user.

The scheduler's counters (prefix-cache queries and hits, preemptions) are cumulative since the
engine started; both loggers turn them into deltas (`delta`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pagellm.metrics.prometheus import PrometheusStatLogger, delta
from pagellm.metrics.stats import IterationStats, SchedulerStats, StatLoggerBase

logger = logging.getLogger(__name__)


class LoggingStatLogger(StatLoggerBase):
    """Logs one line per `log()` call: throughput and prefix-cache hit rate over the interval since
    the previous call, and the latest scheduler state. An idle engine is logged once, not every
    interval."""

    def __init__(self, model_name: str = "", clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(model_name)
        self._clock = clock
        self._last_log_time = clock()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._latest: SchedulerStats | None = None
        self._logged: SchedulerStats = SchedulerStats()
        self._logged_idle = False

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        if iteration_stats is not None:
            self._prompt_tokens += iteration_stats.num_prompt_tokens
            self._generation_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is not None:
            self._latest = scheduler_stats

    def log(self) -> None:
        now = self._clock()
        interval = max(now - self._last_log_time, 1e-9)
        latest = self._latest or self._logged
        queries = delta(latest.prefix_cache_queries, self._logged.prefix_cache_queries)
        hits = delta(latest.prefix_cache_hits, self._logged.prefix_cache_hits)
        preemptions = delta(latest.num_preemptions, self._logged.num_preemptions)
        busy = self._prompt_tokens or self._generation_tokens
        waiting = latest.num_waiting_reqs + latest.num_deferred_reqs
        idle = not (busy or latest.num_running_reqs or waiting)
        if not (idle and self._logged_idle):
            logger.info(
                "Prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, "
                "running: %d reqs, waiting: %d reqs, KV cache usage: %.1f%%, "
                "prefix cache hit rate: %.1f%%, preemptions: %d",
                self._prompt_tokens / interval,
                self._generation_tokens / interval,
                latest.num_running_reqs,
                waiting,
                latest.kv_cache_usage * 100,
                hits / queries * 100 if queries else 0.0,
                preemptions,
            )
        self._logged_idle = idle
        self._last_log_time = now
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._logged = latest


BUILTIN_STAT_LOGGERS: dict[str, type[StatLoggerBase]] = {
    "logging": LoggingStatLogger,
    "prometheus": PrometheusStatLogger,
}


def build_stat_loggers(
    model_name: str, names: list[str] | None = None, log_stats: bool = True
) -> list[StatLoggerBase]:
    """The built-in loggers (logging, unless ``log_stats`` is False, then Prometheus, always on)
    followed by the plugin stat loggers in ``names``, each built as
    ``cls(model_name=model_name)``."""
    from pagellm.metrics.registry import stat_loggers

    loggers: list[StatLoggerBase] = [
        cls(model_name=model_name)
        for name, cls in BUILTIN_STAT_LOGGERS.items()
        if log_stats or name != "logging"
    ]
    for name in names or ():
        if name in BUILTIN_STAT_LOGGERS:
            installed = ", ".join(stat_loggers.names()) or "none installed"
            raise ValueError(
                f"Stat logger {name!r} is built in and always on; name only plugin stat loggers "
                f"({installed})."
            )
        loggers.append(stat_loggers.get(name)(model_name=model_name))
    return loggers
