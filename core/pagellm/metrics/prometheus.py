"""`PrometheusStatLogger`: vLLM's Prometheus metrics under the ``pagellm:`` prefix, for the core's
``/metrics`` route (`metrics_response`). docs/serving.md (Metrics) lists each one against vLLM's.

The scheduler's counters (prefix-cache queries and hits, preemptions, steps) are cumulative since
the engine started; they become increments here. A counter that goes backwards (a restarted engine
core) counts from zero again.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter
from typing import TYPE_CHECKING, TypeVar

import prometheus_client as prom
from prometheus_client.metrics import MetricWrapperBase

from pagellm.metrics.stats import (
    FinishedRequestStats,
    IterationStats,
    SchedulerStats,
    StatLoggerBase,
)
from pagellm.request import FinishReason

if TYPE_CHECKING:
    from pagellm.config import EngineConfig


_Metric = TypeVar("_Metric", bound=MetricWrapperBase)


def delta(current: int, previous: int) -> int:
    """The increment of a cumulative engine counter (all of it after a restart)."""
    return current - previous if current >= previous else current


def observe_all(histogram: prom.Histogram, values: list[float]) -> None:
    """``histogram.observe`` of every value, adding to each bucket once: inter-token latencies
    come one per streamed token, and one observe (a search over the buckets in Python, two
    locked additions) costs more than the rest of a token's stats. Through the histogram's own
    buckets (prometheus_client's attributes; value by value if a version lacks them)."""
    if len(values) < 2:
        for value in values:
            histogram.observe(value)
        return
    try:
        bounds, buckets, total = histogram._upper_bounds, histogram._buckets, histogram._sum
    except AttributeError:
        for value in values:
            histogram.observe(value)
        return
    counts = Counter(bisect_left(bounds, value) for value in values)  # the first bound >= it
    for index, count in counts.items():
        buckets[index].inc(count)
    total.inc(math.fsum(values))


_LATENCY_BUCKETS_S = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
]  # fmt: skip
_ITL_BUCKETS_S = [
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
]  # fmt: skip
_TOKEN_BUCKETS = [float(m * 10**e) for e in range(6) for m in (1, 2, 5)]
_ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
_N_BUCKETS = [1, 2, 5, 10, 20]
_RESIDENCY_BUCKETS_S = [
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
    10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0,
]  # fmt: skip

WAITING_REASONS = ("capacity", "deferred")
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
"""vLLM's sources; ``external_kv_transfer`` (a KV connector's) stays 0: pagellm has none."""


class PrometheusStatLogger(StatLoggerBase):
    """Prometheus metrics in a registry of its own (``self.registry``), so that several instances
    can live in one process; expose them with `metrics_response`. Every metric carries a
    ``model_name`` label, and all but those that need the started engine's configuration
    (``cache_config_info``, the ``kv_block_*`` residency histograms of ``--kv-cache-metrics``)
    are exposed, at zero, from the start."""

    def __init__(self, model_name: str = "") -> None:
        super().__init__(model_name)
        registry = self.registry = prom.CollectorRegistry()
        self._cache_config_info: prom.Gauge | None = None
        # With --kv-cache-metrics: lifetime, idle time before eviction, reuse gaps.
        self._kv_block_residency: tuple[prom.Histogram, prom.Histogram, prom.Histogram] | None
        self._kv_block_residency = None

        def labelled(
            kind: type[_Metric], name: str, doc: str, label: str, values: tuple[str, ...]
        ) -> dict[str, _Metric]:
            metric = kind(name, doc, ["model_name", label], registry=registry)
            return {value: metric.labels(model_name, value) for value in values}

        def gauge(name: str, doc: str) -> prom.Gauge:
            return prom.Gauge(name, doc, ["model_name"], registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> prom.Counter:
            return prom.Counter(name, doc, ["model_name"], registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: list[float] | list[int]) -> prom.Histogram:
            metric = prom.Histogram(name, doc, ["model_name"], buckets=buckets, registry=registry)
            return metric.labels(model_name)

        # Scheduler and KV cache state.
        self._running = gauge("pagellm:num_requests_running", "Requests being run.")
        self._waiting = gauge(
            "pagellm:num_requests_waiting", "Requests waiting to be scheduled (every reason)."
        )
        self._waiting_by_reason = labelled(
            prom.Gauge,
            "pagellm:num_requests_waiting_by_reason",
            "Waiting requests by reason: 'capacity' = waiting for room in the batch or the KV "
            "cache; 'deferred' = set apart after a failed step, waiting to run alone.",
            "reason",
            WAITING_REASONS,
        )
        self._kv_usage = gauge(
            "pagellm:kv_cache_usage_perc", "Fraction of the KV cache's blocks in use (0 to 1)."
        )
        self._prefix_queries = counter(
            "pagellm:prefix_cache_queries_total", "Tokens looked up in the prefix cache."
        )
        self._prefix_hits = counter(
            "pagellm:prefix_cache_hits_total", "Tokens found in the prefix cache."
        )
        self._preemptions = counter("pagellm:num_preemptions_total", "Requests preempted.")
        self._iteration_tokens = histogram(
            "pagellm:iteration_tokens_total",
            "Tokens computed per engine step.",
            _ITERATION_TOKEN_BUCKETS,
        )
        # Tokens.
        self._prompt_tokens = counter("pagellm:prompt_tokens_total", "Prompt tokens processed.")
        self._prompt_tokens_by_source = labelled(
            prom.Counter,
            "pagellm:prompt_tokens_by_source_total",
            "Prompt tokens by source: computed here, found in the prefix cache, or transferred "
            "by a KV connector (none in pagellm).",
            "source",
            PROMPT_TOKEN_SOURCES,
        )
        self._prompt_tokens_cached = counter(
            "pagellm:prompt_tokens_cached_total", "Prompt tokens found in the prefix cache."
        )
        self._generation_tokens = counter("pagellm:generation_tokens_total", "Tokens generated.")
        # Finished requests.
        self._success = labelled(
            prom.Counter,
            "pagellm:request_success_total",
            "Requests finished, by finish reason.",
            "finished_reason",
            tuple(str(reason) for reason in FinishReason),
        )
        self._request_prompt_tokens = histogram(
            "pagellm:request_prompt_tokens", "Prompt tokens of finished requests.", _TOKEN_BUCKETS
        )
        self._request_generation_tokens = histogram(
            "pagellm:request_generation_tokens",
            "Generated tokens of finished requests.",
            _TOKEN_BUCKETS,
        )
        self._request_prefill_kv_computed = histogram(
            "pagellm:request_prefill_kv_computed_tokens",
            "Prompt tokens a finished request computed (those not found in the prefix cache).",
            _TOKEN_BUCKETS,
        )
        self._request_max_tokens = histogram(
            "pagellm:request_params_max_tokens",
            "The max_tokens parameter of finished requests.",
            _TOKEN_BUCKETS,
        )
        self._request_n = histogram(
            "pagellm:request_params_n", "The n parameter of finished user requests.", _N_BUCKETS
        )
        self._request_max_generation_tokens = histogram(
            "pagellm:request_max_num_generation_tokens",
            "Most tokens generated by one completion of a finished user request.",
            _TOKEN_BUCKETS,
        )
        # Latencies.
        self._ttft = histogram(
            "pagellm:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS_S
        )
        self._itl = histogram(
            "pagellm:inter_token_latency_seconds", "Time between generated tokens.", _ITL_BUCKETS_S
        )
        self._tpot = histogram(
            "pagellm:request_time_per_output_token_seconds",
            "Mean time per output token after the first, per finished request.",
            _ITL_BUCKETS_S,
        )
        self._e2e = histogram(
            "pagellm:e2e_request_latency_seconds",
            "Time from arrival to the request's end.",
            _LATENCY_BUCKETS_S,
        )
        self._queue_time = histogram(
            "pagellm:request_queue_time_seconds",
            "Time a request waited in the engine before its first scheduling.",
            _LATENCY_BUCKETS_S,
        )
        self._prefill_time = histogram(
            "pagellm:request_prefill_time_seconds",
            "Time from a request's first scheduling to its first token.",
            _LATENCY_BUCKETS_S,
        )
        self._decode_time = histogram(
            "pagellm:request_decode_time_seconds",
            "Time from a request's first token to its last.",
            _LATENCY_BUCKETS_S,
        )
        self._inference_time = histogram(
            "pagellm:request_inference_time_seconds",
            "Time from a request's first scheduling to its last token.",
            _LATENCY_BUCKETS_S,
        )
        self._last = SchedulerStats()

    def log_engine_initialized(self, config: EngineConfig, num_gpu_blocks: int) -> None:
        """``pagellm:cache_config_info``: a gauge at 1 whose labels are the cache configuration."""
        info = {key: str(value) for key, value in config.cache.model_dump().items()}
        info["cache_dtype"] = config.model.dtype  # the KV cache is kept in the model's dtype
        info["num_gpu_blocks"] = str(num_gpu_blocks)
        if self._cache_config_info is not None:
            self.registry.unregister(self._cache_config_info)
        self._cache_config_info = prom.Gauge(
            "pagellm:cache_config_info",
            "The engine's KV cache configuration (labels); always 1.",
            ["model_name", *info],
            registry=self.registry,
        )
        self._cache_config_info.labels(self.model_name, *info.values()).set(1)
        if config.observability.kv_cache_metrics and self._kv_block_residency is None:
            self._kv_block_residency = tuple(  # type: ignore[assignment]
                prom.Histogram(
                    name, doc, ["model_name"], buckets=_RESIDENCY_BUCKETS_S, registry=self.registry
                ).labels(self.model_name)
                for name, doc in (
                    (
                        "pagellm:kv_block_lifetime_seconds",
                        "Sampled KV blocks: time from allocation to eviction.",
                    ),
                    (
                        "pagellm:kv_block_idle_before_evict_seconds",
                        "Sampled KV blocks: time from the last use to eviction.",
                    ),
                    (
                        "pagellm:kv_block_reuse_gap_seconds",
                        "Sampled KV blocks: time between consecutive prefix-cache hits (the "
                        "last few of each block).",
                    ),
                )
            )

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        if scheduler_stats is not None:
            self._record_scheduler(scheduler_stats)
        if iteration_stats is not None:
            self._record_iteration(iteration_stats)

    def _record_scheduler(self, s: SchedulerStats) -> None:
        last = self._last
        self._running.set(s.num_running_reqs)
        self._waiting.set(s.num_waiting_reqs + s.num_deferred_reqs)
        self._waiting_by_reason["capacity"].set(s.num_waiting_reqs)
        self._waiting_by_reason["deferred"].set(s.num_deferred_reqs)
        self._kv_usage.set(s.kv_cache_usage)
        self._prefix_queries.inc(delta(s.prefix_cache_queries, last.prefix_cache_queries))
        self._prefix_hits.inc(delta(s.prefix_cache_hits, last.prefix_cache_hits))
        self._preemptions.inc(delta(s.num_preemptions, last.num_preemptions))
        if s.num_steps != last.num_steps:  # stats sent without a step (after an abort) repeat it
            self._iteration_tokens.observe(s.num_scheduled_tokens)
            if self._kv_block_residency is not None:
                lifetime, idle, reuse_gap = self._kv_block_residency
                for eviction in s.kv_block_evictions:
                    lifetime.observe(eviction.lifetime_s)
                    idle.observe(eviction.idle_s)
                    for gap in eviction.reuse_gaps_s:
                        reuse_gap.observe(gap)
        self._last = s

    def _record_iteration(self, it: IterationStats) -> None:
        self._prompt_tokens.inc(it.num_prompt_tokens)
        cached = it.num_cached_prompt_tokens
        self._prompt_tokens_by_source["local_compute"].inc(it.num_prompt_tokens - cached)
        self._prompt_tokens_by_source["local_cache_hit"].inc(cached)
        self._prompt_tokens_cached.inc(cached)
        self._generation_tokens.inc(it.num_generation_tokens)
        for t in it.ttfts_s:
            self._ttft.observe(t)
        observe_all(self._itl, it.itls_s)
        for f in it.finished:
            self._record_finished(f)
        for user_request in it.finished_user_requests:
            self._request_n.observe(user_request.n)
            self._request_max_generation_tokens.observe(user_request.max_num_generation_tokens)

    def _record_finished(self, f: FinishedRequestStats) -> None:
        self._success[f.finish_reason].inc()
        self._e2e.observe(f.e2e_latency_s)
        self._request_prompt_tokens.observe(f.num_prompt_tokens)
        self._request_generation_tokens.observe(f.num_generation_tokens)
        self._request_prefill_kv_computed.observe(f.num_prompt_tokens - f.num_cached_tokens)
        if f.max_tokens is not None:
            self._request_max_tokens.observe(f.max_tokens)
        # What a request never reached is not observed (a zero would pull the distributions
        # down): the intervals of one aborted while waiting or before its first token, the time
        # per output token of one with a single token.
        for histogram, value in (
            (self._tpot, f.mean_itl_s),
            (self._queue_time, f.queue_time_s),
            (self._prefill_time, f.prefill_time_s),
            (self._decode_time, f.decode_time_s),
            (self._inference_time, f.inference_time_s),
        ):
            if value is not None:
                histogram.observe(value)


def metrics_response(stat_logger: PrometheusStatLogger) -> tuple[bytes, str]:
    """The body and content type of a ``/metrics`` response (Prometheus text format)."""
    return prom.generate_latest(stat_logger.registry), prom.CONTENT_TYPE_LATEST
