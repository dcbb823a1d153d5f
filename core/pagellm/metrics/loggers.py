"""The built-in stat loggers (a periodic log line, and Prometheus metrics for ``/metrics``) and
`build_stat_loggers`, which adds the plugin ones named by the user.

The scheduler's counters (prefix-cache queries and hits, preemptions) are cumulative since the
engine started; both loggers turn them into deltas. A counter that goes backwards (a restarted
engine core) counts from zero again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import prometheus_client as prom

from pagellm.metrics.stats import IterationStats, SchedulerStats, StatLoggerBase
from pagellm.request import FinishReason

logger = logging.getLogger(__name__)


def _delta(current: int, previous: int) -> int:
    return current - previous if current >= previous else current


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
        queries = _delta(latest.prefix_cache_queries, self._logged.prefix_cache_queries)
        hits = _delta(latest.prefix_cache_hits, self._logged.prefix_cache_hits)
        preemptions = _delta(latest.num_preemptions, self._logged.num_preemptions)
        busy = self._prompt_tokens or self._generation_tokens
        idle = not (busy or latest.num_running_reqs or latest.num_waiting_reqs)
        if not (idle and self._logged_idle):
            logger.info(
                "Prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, "
                "running: %d reqs, waiting: %d reqs, KV cache usage: %.1f%%, "
                "prefix cache hit rate: %.1f%%, preemptions: %d",
                self._prompt_tokens / interval,
                self._generation_tokens / interval,
                latest.num_running_reqs,
                latest.num_waiting_reqs,
                latest.kv_cache_usage * 100,
                hits / queries * 100 if queries else 0.0,
                preemptions,
            )
        self._logged_idle = idle
        self._last_log_time = now
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._logged = latest


_LATENCY_BUCKETS_S = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
]  # fmt: skip
_ITL_BUCKETS_S = [
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
]  # fmt: skip
_TOKEN_BUCKETS = [float(m * 10**e) for e in range(6) for m in (1, 2, 5)]


class PrometheusStatLogger(StatLoggerBase):
    """Prometheus metrics in a registry of its own (``self.registry``), so that several instances
    can live in one process; expose them with `metrics_response`. Every
    metric carries a ``model_name`` label."""

    def __init__(self, model_name: str = "") -> None:
        super().__init__(model_name)
        self.registry = prom.CollectorRegistry()
        label = ["model_name"]

        # Children are made up front so that every metric is exposed (at zero) from the start.
        def gauge(name: str, doc: str) -> prom.Gauge:
            return prom.Gauge(name, doc, label, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> prom.Counter:
            return prom.Counter(name, doc, label, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: list[float]) -> prom.Histogram:
            metric = prom.Histogram(name, doc, label, buckets=buckets, registry=self.registry)
            return metric.labels(model_name)

        self._running = gauge("pagellm:num_requests_running", "Requests being run.")
        self._waiting = gauge("pagellm:num_requests_waiting", "Requests waiting to be scheduled.")
        self._kv_usage = gauge(
            "pagellm:kv_cache_usage_perc", "Fraction of the KV cache's blocks in use (0 to 1)."
        )
        self._prompt_tokens = counter("pagellm:prompt_tokens_total", "Prompt tokens processed.")
        self._generation_tokens = counter("pagellm:generation_tokens_total", "Tokens generated.")
        self._preemptions = counter("pagellm:num_preemptions_total", "Requests preempted.")
        self._prefix_queries = counter(
            "pagellm:prefix_cache_queries_total", "Tokens looked up in the prefix cache."
        )
        self._prefix_hits = counter(
            "pagellm:prefix_cache_hits_total", "Tokens found in the prefix cache."
        )
        self._success = prom.Counter(
            "pagellm:request_success_total",
            "Requests finished, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        for reason in FinishReason:
            self._success.labels(model_name, str(reason))
        self._ttft = histogram(
            "pagellm:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS_S
        )
        self._itl = histogram(
            "pagellm:inter_token_latency_seconds", "Time between generated tokens.", _ITL_BUCKETS_S
        )
        self._e2e = histogram(
            "pagellm:e2e_request_latency_seconds",
            "Time from arrival to the request's end.",
            _LATENCY_BUCKETS_S,
        )
        self._request_prompt_tokens = histogram(
            "pagellm:request_prompt_tokens", "Prompt tokens of finished requests.", _TOKEN_BUCKETS
        )
        self._request_generation_tokens = histogram(
            "pagellm:request_generation_tokens",
            "Generated tokens of finished requests.",
            _TOKEN_BUCKETS,
        )
        self._last = SchedulerStats()

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        if scheduler_stats is not None:
            s, last = scheduler_stats, self._last
            self._running.set(s.num_running_reqs)
            self._waiting.set(s.num_waiting_reqs)
            self._kv_usage.set(s.kv_cache_usage)
            self._prefix_queries.inc(_delta(s.prefix_cache_queries, last.prefix_cache_queries))
            self._prefix_hits.inc(_delta(s.prefix_cache_hits, last.prefix_cache_hits))
            self._preemptions.inc(_delta(s.num_preemptions, last.num_preemptions))
            self._last = s
        if iteration_stats is not None:
            it = iteration_stats
            self._prompt_tokens.inc(it.num_prompt_tokens)
            self._generation_tokens.inc(it.num_generation_tokens)
            for t in it.ttfts_s:
                self._ttft.observe(t)
            for t in it.itls_s:
                self._itl.observe(t)
            for f in it.finished:
                self._success.labels(self.model_name, f.finish_reason).inc()
                self._e2e.observe(f.e2e_latency_s)
                self._request_prompt_tokens.observe(f.num_prompt_tokens)
                self._request_generation_tokens.observe(f.num_generation_tokens)


def metrics_response(stat_logger: PrometheusStatLogger) -> tuple[bytes, str]:
    """The body and content type of a ``/metrics`` response (Prometheus text format)."""
    return prom.generate_latest(stat_logger.registry), prom.CONTENT_TYPE_LATEST


BUILTIN_STAT_LOGGERS: dict[str, type[StatLoggerBase]] = {
    "logging": LoggingStatLogger,
    "prometheus": PrometheusStatLogger,
}


def build_stat_loggers(model_name: str, names: list[str] | None = None) -> list[StatLoggerBase]:
    """The built-in loggers (always on: logging, then Prometheus) followed by the plugin stat
    loggers in ``names``, each built as ``cls(model_name=model_name)``."""
    from pagellm.metrics.registry import stat_loggers

    loggers: list[StatLoggerBase] = [
        cls(model_name=model_name) for cls in BUILTIN_STAT_LOGGERS.values()
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
