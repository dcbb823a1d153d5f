"""The statistics the engine reports, and the interface of a stat logger.

`SchedulerStats` is made by the engine core after each step and travels to the front end with the
step's outputs (a msgspec struct: it crosses the process boundary); the admin endpoint's engine
state and the benchmarks read it too. `IterationStats` is made by the
front end from the outputs it processed in one batch: token counts, time to first token and
inter-token latencies, one `FinishedRequestStats` per completion that ended and one
`FinishedUserRequestStats` per user request whose completions all ended. Stat loggers (the
built-in logging and Prometheus ones, and those of ``pagellm.stat_logger_plugins``) receive both.

Two clocks: the front end's (`time.monotonic()` in its process) for what the client sees (time to
first token, end-to-end latency); the engine core's (the outputs' and request events' timestamps)
for the intervals inside the engine (queue, prefill, decode, inference time, inter-token latency).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from pagellm.kv_cache.residency import KVBlockEviction

if TYPE_CHECKING:
    from pagellm.config import EngineConfig


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    """Requests waiting for room in the batch or the KV cache (vLLM's waiting reason "capacity")."""
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
    num_deferred_reqs: int = 0
    """Requests set apart after a failed step, each waiting for its turn to run alone (vLLM's
    waiting reason "deferred": held back by a transient constraint, not by a lack of room)."""
    kv_block_evictions: list[KVBlockEviction] = []
    """Sampled cached blocks the last step evicted (with ``--kv-cache-metrics``)."""


@dataclass
class FinishedRequestStats:
    """One completion (engine request) that ended. The engine-side intervals are None when the
    request never got that far (aborted while waiting, or before its first token)."""

    finish_reason: str
    e2e_latency_s: float
    num_prompt_tokens: int
    num_generation_tokens: int
    ttft_s: float | None
    """Time to first token (None when the request ended before producing one)."""
    mean_itl_s: float | None
    """Mean time per output token after the first: decode time / (generated tokens - 1); None
    with fewer than two generated tokens."""
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache when it was first scheduled."""
    max_tokens: int | None = None
    """The request's ``max_tokens`` parameter."""
    queue_time_s: float | None = None
    """From the engine core taking it in to its first scheduling."""
    prefill_time_s: float | None = None
    """From its first scheduling to its first token (preemptions in between included)."""
    decode_time_s: float | None = None
    """From its first token to its last."""
    inference_time_s: float | None = None
    """From its first scheduling to its last token."""


@dataclass
class FinishedUserRequestStats:
    """A user request whose completions (``n`` of them) all ended."""

    n: int
    max_num_generation_tokens: int
    """The most tokens one of its completions generated."""


@dataclass
class IterationStats:
    num_prompt_tokens: int = 0
    """Prompt tokens of the requests that produced their first token in this batch."""
    num_cached_prompt_tokens: int = 0
    """Of those, tokens the prefix cache held (not computed)."""
    num_generation_tokens: int = 0
    ttfts_s: list[float] = field(default_factory=list)
    itls_s: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    finished_user_requests: list[FinishedUserRequestStats] = field(default_factory=list)


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

    def log_engine_initialized(self, config: EngineConfig, num_gpu_blocks: int) -> None:  # noqa: B027
        """Called once, when the engine core is up: its configuration and the KV cache blocks
        it sized (the null block included), e.g. for a config-info metric (optional)."""
