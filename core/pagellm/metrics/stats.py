"""The statistics the engine reports, and the interface of a stat logger.

`SchedulerStats` is made by the engine core after each step and travels to the front end with the
step's outputs (a msgspec struct: it crosses the process boundary); the admin endpoint's engine
state and the benchmarks read it too. `IterationStats` is made by the
front end from the outputs it processed in one batch: token counts, time to first token and
inter-token latencies, and one `FinishedRequestStats` per request that ended. Stat loggers (the
built-in logging and Prometheus ones, and those of ``pagellm.stat_logger_plugins``) receive both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    """Fraction of the KV cache's blocks in use (0..1)."""
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0
    """Tokens looked up in the prefix cache so far (cumulative)."""
    prefix_cache_hits: int = 0
    """Of those, tokens found (cumulative)."""
    num_preemptions: int = 0
    """Preemptions so far (cumulative)."""
    num_steps: int = 0
    """Engine steps so far (cumulative)."""
    num_scheduled_reqs: int = 0
    """Requests the last step ran."""
    num_scheduled_tokens: int = 0
    """Tokens the last step computed (equal to ``num_scheduled_reqs`` for a decode-only step)."""
    num_context_tokens: int = 0
    """Sum over the last step's requests of their context length after it (KV tokens attended)."""


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency_s: float
    num_prompt_tokens: int
    num_generation_tokens: int
    ttft_s: float | None
    """Time to first token (None when the request ended before producing one)."""
    mean_itl_s: float | None
    """Mean inter-token latency over the request's generated tokens."""


@dataclass
class IterationStats:
    num_prompt_tokens: int = 0
    """Prompt tokens of the requests that produced their first token in this batch."""
    num_generation_tokens: int = 0
    ttfts_s: list[float] = field(default_factory=list)
    itls_s: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


class StatLoggerBase:
    """A stat logger: `record` is called for every batch of engine outputs the front end
    processes; `log` periodically (e.g. every few seconds) for loggers that summarise. Loggers are
    built as ``cls(model_name=...)`` (the served model's name)."""

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None
    ) -> None:
        raise NotImplementedError

    def log(self) -> None:  # noqa: B027 (optional: loggers that only record need nothing here)
        """Emit a periodic summary (optional)."""
