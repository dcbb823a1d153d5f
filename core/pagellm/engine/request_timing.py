"""Front-end timestamps of running requests, turned into the `IterationStats` the stat loggers get:
time to first token, inter-token latencies, and one `FinishedRequestStats` per ended completion."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagellm.metrics.stats import FinishedRequestStats, IterationStats
from pagellm.outputs import RequestOutput
from pagellm.scheduler.output import EngineCoreOutputs


@dataclass(slots=True)
class CompletionTiming:
    """One engine request (one completion of a user request); times are `time.monotonic()`."""

    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None
    last_token: float = 0.0
    num_generation_tokens: int = 0
    num_itls: int = 0

    def finished(self, reason: str, now: float) -> FinishedRequestStats:
        first = self.first_token
        return FinishedRequestStats(
            finish_reason=reason,
            e2e_latency_s=now - self.arrival,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            ttft_s=None if first is None else first - self.arrival,
            # The inter-token latencies add up to the time from the first token to the last.
            mean_itl_s=(self.last_token - first) / self.num_itls
            if self.num_itls and first is not None
            else None,
        )


class RequestTimings:
    """The timings of every request started here and not yet ended."""

    def __init__(self) -> None:
        self._completions: dict[str, CompletionTiming] = {}
        self._engine_ids: dict[str, list[str]] = {}

    def start(self, request_id: str, engine_ids: list[str], num_prompt_tokens: int) -> None:
        now = time.monotonic()
        self._engine_ids[request_id] = engine_ids
        for engine_id in engine_ids:
            self._completions[engine_id] = CompletionTiming(now, num_prompt_tokens)

    def step(
        self, engine_outputs: EngineCoreOutputs, results: list[RequestOutput]
    ) -> IterationStats:
        """One engine step's stats: its new tokens, and the completions its ``results`` end."""
        now = time.monotonic()
        stats = IterationStats()
        completions = self._completions
        for out in engine_outputs.outputs:
            timing = completions.get(out.request_id)
            num_new = len(out.new_token_ids)
            if timing is None or not num_new:
                continue
            stats.num_generation_tokens += num_new
            if timing.first_token is None:
                timing.first_token = now
                stats.ttfts_s.append(now - timing.arrival)
                stats.num_prompt_tokens += timing.num_prompt_tokens
            else:
                stats.itls_s.append(now - timing.last_token)
                timing.num_itls += 1
            timing.last_token = now
            timing.num_generation_tokens += num_new
        for output in results:
            engine_ids = self._engine_ids.get(output.request_id, [])
            for completion in output.outputs:
                # A completion that ended before its siblings is reported then (delta outputs
                # name its finish once; cumulative ones again, but its timing is gone by then).
                if completion.finish_reason is not None and completion.index < len(engine_ids):
                    timing = completions.pop(engine_ids[completion.index], None)
                    if timing is not None:
                        stats.finished.append(timing.finished(completion.finish_reason, now))
            if output.finished:
                self._forget(output.request_id)
        return stats

    def abort(self, request_id: str) -> IterationStats | None:
        """The stats of an aborted request's completions that had not ended (None: none)."""
        now = time.monotonic()
        finished = [t.finished("abort", now) for t in self._forget(request_id)]
        return IterationStats(finished=finished) if finished else None

    def _forget(self, request_id: str) -> list[CompletionTiming]:
        engine_ids = self._engine_ids.pop(request_id, [])
        timings = (self._completions.pop(e, None) for e in engine_ids)
        return [t for t in timings if t is not None]
