"""Timestamps of running requests, turned into the `IterationStats` the stat loggers get: time to
first token and inter-token latencies per step, one `FinishedRequestStats` per ended completion
and one `FinishedUserRequestStats` per ended user request.

Client-side times (arrival, time to first token, end to end) are on this process's clock; the
engine-side ones (queued, first scheduled, each token) are the engine core's timestamps, carried by
its outputs and request events (see `pagellm.metrics.stats`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagellm.metrics.stats import FinishedRequestStats, FinishedUserRequestStats, IterationStats
from pagellm.outputs import AnyRequestOutput, RequestOutput
from pagellm.scheduler.output import EngineCoreOutputs, RequestEventType


@dataclass(slots=True)
class CompletionTiming:
    """One engine request (one completion of a user request)."""

    arrival: float
    """This process's `time.monotonic()` when the request came."""
    num_prompt_tokens: int
    max_tokens: int | None
    # The engine core's clock; None until it happened.
    queued: float | None = None
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float = 0.0
    ttft: float | None = None
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0

    def finished(self, reason: str, now: float) -> FinishedRequestStats:
        first, scheduled, last = self.first_token, self.scheduled, self.last_token
        num_generated = self.num_generation_tokens
        return FinishedRequestStats(
            finish_reason=reason,
            e2e_latency_s=now - self.arrival,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=num_generated,
            ttft_s=self.ttft,
            mean_itl_s=(last - first) / (num_generated - 1)
            if first is not None and num_generated > 1
            else None,
            num_cached_tokens=self.num_cached_tokens,
            max_tokens=self.max_tokens,
            queue_time_s=scheduled - self.queued
            if scheduled is not None and self.queued is not None
            else None,
            prefill_time_s=first - scheduled
            if first is not None and scheduled is not None
            else None,
            decode_time_s=last - first if first is not None else None,
            inference_time_s=last - scheduled
            if first is not None and scheduled is not None
            else None,
        )


@dataclass(slots=True)
class UserRequestTiming:
    engine_ids: list[str]
    max_num_generation_tokens: int = 0
    """Over its completions that ended so far."""

    def finished(self) -> FinishedUserRequestStats:
        return FinishedUserRequestStats(len(self.engine_ids), self.max_num_generation_tokens)


class RequestTimings:
    """The timings of every request started here and not yet ended."""

    def __init__(self) -> None:
        self._completions: dict[str, CompletionTiming] = {}
        self._requests: dict[str, UserRequestTiming] = {}

    def start(
        self,
        request_id: str,
        engine_ids: list[str],
        num_prompt_tokens: int,
        max_tokens: int | None,
        arrival: float,
    ) -> None:
        """Follow a user request that came at ``arrival`` (`time.monotonic()`, before it was
        tokenized and sent to the engine core) and runs as ``engine_ids``."""
        self._requests[request_id] = UserRequestTiming(engine_ids)
        for engine_id in engine_ids:
            self._completions[engine_id] = CompletionTiming(arrival, num_prompt_tokens, max_tokens)

    def step(
        self, engine_outputs: EngineCoreOutputs, results: list[AnyRequestOutput]
    ) -> IterationStats:
        """One engine step's stats: its new tokens, and the completions its ``results`` end. A
        pooling request's vector counts as its first token (its prompt tokens, its time to the
        result as time to first token) with no generation tokens."""
        now = time.monotonic()
        engine_now = engine_outputs.timestamp
        stats = IterationStats()
        completions = self._completions
        for event in engine_outputs.events:  # state changes only: few, and before the tokens
            timing = completions.get(event.request_id)
            if timing is None:
                continue
            if event.type == RequestEventType.QUEUED:
                timing.queued = event.timestamp
            elif event.type == RequestEventType.SCHEDULED:
                timing.scheduled = event.timestamp
        for out in engine_outputs.outputs:
            timing = completions.get(out.request_id)
            num_new = len(out.new_token_ids)
            if timing is None or not (num_new or out.pooled is not None):
                continue
            stats.num_generation_tokens += num_new
            if timing.first_token is None:
                timing.first_token = engine_now
                timing.ttft = now - timing.arrival
                timing.num_cached_tokens = out.num_cached_tokens
                stats.ttfts_s.append(timing.ttft)
                stats.num_prompt_tokens += timing.num_prompt_tokens
                stats.num_cached_prompt_tokens += out.num_cached_tokens
            else:
                stats.itls_s.append(engine_now - timing.last_token)
            timing.last_token = engine_now
            timing.num_generation_tokens += num_new
        for output in results:
            request = self._requests.get(output.request_id)
            if request is None:
                continue
            engine_ids = request.engine_ids
            if not output.finished and len(engine_ids) == 1:
                continue  # a streamed token's output: nothing of it ended
            ends = (
                [(c.index, c.finish_reason) for c in output.outputs]
                if isinstance(output, RequestOutput)
                else [(0, output.finish_reason)]
            )
            for index, finish_reason in ends:
                # A completion that ended before its siblings is reported then (delta outputs
                # name its finish once; cumulative ones again, but its timing is gone by then).
                if finish_reason is not None and index < len(engine_ids):
                    timing = completions.pop(engine_ids[index], None)
                    if timing is not None:
                        stats.finished.append(timing.finished(finish_reason, now))
                        request.max_num_generation_tokens = max(
                            request.max_num_generation_tokens, timing.num_generation_tokens
                        )
            if output.finished:
                self._forget(output.request_id)
                stats.finished_user_requests.append(request.finished())
        return stats

    def abort(self, request_id: str) -> IterationStats | None:
        """The stats of an aborted request's completions that had not ended (None: none)."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        now = time.monotonic()
        timings = self._forget(request_id)
        for t in timings:
            request.max_num_generation_tokens = max(
                request.max_num_generation_tokens, t.num_generation_tokens
            )
        return IterationStats(
            finished=[t.finished("abort", now) for t in timings],
            finished_user_requests=[request.finished()],
        )

    def _forget(self, request_id: str) -> list[CompletionTiming]:
        request = self._requests.pop(request_id, None)
        engine_ids = request.engine_ids if request is not None else []
        timings = (self._completions.pop(e, None) for e in engine_ids)
        return [t for t in timings if t is not None]
