"""`AsyncLLM`: the asyncio front end (the API server's engine client).

The engine core runs in its own process (`AsyncMPClient`); this process keeps tokenization,
validation, the ``n > 1`` fan-out, detokenization, stop strings and output kinds (the same
`InputProcessor` and `OutputProcessor` as `LLMEngine`), one asyncio queue per request fed by the
client's output task, and the stats handed to the stat loggers.

A request's outputs wait in a `RequestOutputCollector`, one slot rather than a queue: when its
consumer (an HTTP stream) falls behind the engine, the deltas that pile up are merged into one
output, so a busy front end sends fewer, larger chunks instead of falling further behind.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pagellm.config import EngineConfig
from pagellm.engine.args import EngineArgs
from pagellm.engine.async_core_client import AsyncMPClient
from pagellm.engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
)
from pagellm.engine.llm_engine import child_params, engine_request_ids
from pagellm.engine.messages import EngineStepOutputs
from pagellm.engine.output_collector import RequestOutputCollector
from pagellm.engine.output_processor import OutputProcessor
from pagellm.engine.processor import InputProcessor, PromptType
from pagellm.metrics.stats import (
    FinishedRequestStats,
    IterationStats,
    SchedulerStats,
    StatLoggerBase,
)
from pagellm.outputs import RequestOutput
from pagellm.plugins import load_frontend_plugins, load_general_plugins
from pagellm.request import FinishReason
from pagellm.sampling_params import SamplingParams
from pagellm.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)

_LOG_INTERVAL_S = 5.0
_ERROR = str(FinishReason.ERROR)


@dataclass(slots=True)
class _Timing:
    """Front-end timestamps of one engine request (`time.monotonic()`), for the stat loggers."""

    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None
    last_token: float = 0.0
    num_generation_tokens: int = 0
    itl_sum: float = 0.0
    num_itls: int = 0

    def finished(self, reason: str | None, now: float) -> FinishedRequestStats:
        return FinishedRequestStats(
            finish_reason=reason or "abort",
            e2e_latency_s=now - self.arrival,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            ttft_s=None if self.first_token is None else self.first_token - self.arrival,
            mean_itl_s=self.itl_sum / self.num_itls if self.num_itls else None,
        )


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        stat_loggers: list[StatLoggerBase] | None = None,
        max_waiting_requests: int | None = None,
    ) -> None:
        """``max_waiting_requests``: engine requests (one per completion) allowed to wait for the
        engine beyond those it runs; more raise `EngineOverloadedError` (None: no limit)."""
        load_general_plugins()
        load_frontend_plugins()
        self.config = config
        self.tokenizer: Any | None = (
            None if config.model.skip_tokenizer_init else get_tokenizer(config.model.tokenizer)
        )
        self.processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_loggers = list(stat_loggers or [])
        self._streams: dict[str, RequestOutputCollector] = {}
        self._engine_ids: dict[str, list[str]] = {}
        self._timings: dict[str, _Timing] = {}
        self._log_task: asyncio.Task[None] | None = None
        self.max_waiting_requests = max_waiting_requests
        self._num_engine_requests = 0  # submitted and not finished
        self.engine_core = AsyncMPClient(config, self._on_outputs, self._on_dead)

    @classmethod
    def from_engine_args(
        cls,
        args: EngineArgs,
        stat_loggers: list[StatLoggerBase] | None = None,
        max_waiting_requests: int | None = None,
    ) -> AsyncLLM:
        load_general_plugins()  # out-of-tree models must be known before the config is checked
        return cls(args.create_engine_config(), stat_loggers, max_waiting_requests)

    # ---------------------------------------------------------------- requests

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (in ``params.output_kind``), the last one finished.

        Bad input raises ``ValueError`` before anything is queued. If the consumer stops
        iterating or is cancelled, the request is aborted in the engine (its KV blocks freed).
        Raises `EngineDeadError` if the engine process dies.
        """
        self.engine_core.raise_if_dead()
        if request_id in self._engine_ids:
            raise ValueError(f"A request with id {request_id!r} is already running.")
        processed = self.processor.process(prompt, params)
        children = child_params(processed.params)
        engine_ids = engine_request_ids(request_id, len(children))
        requests = [
            self.processor.make_request(engine_id, processed, cparams, priority)
            for engine_id, cparams in zip(engine_ids, children, strict=True)
        ]
        self._check_capacity(len(requests))
        self._start_background_tasks()
        queue = RequestOutputCollector(processed.params.output_kind)
        self.output_processor.add_request(
            request_id, processed.text, processed.token_ids, processed.params, engine_ids, children
        )
        self._streams[request_id] = queue
        self._engine_ids[request_id] = engine_ids
        self._num_engine_requests += len(engine_ids)
        if self.stat_loggers:
            now = time.monotonic()
            for engine_id in engine_ids:
                self._timings[engine_id] = _Timing(now, len(processed.token_ids))
        finished = False
        try:
            for request in requests:
                self.engine_core.add_request(request)
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise type(item)(*item.args)  # one instance per request: its own traceback
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._abort(request_id)

    def _check_capacity(self, num_new: int) -> None:
        limit = self.max_waiting_requests
        if limit is None:
            return
        # Submitted and unfinished beyond what the engine can run at once (up to max_num_seqs):
        # they wait. (When the KV cache, not max_num_seqs, limits the running requests, the
        # queue is longer by that difference: still bounded.)
        waiting = max(0, self._num_engine_requests - self.config.scheduler.max_num_seqs)
        if waiting + num_new > limit:
            raise EngineOverloadedError(
                f"The server is overloaded: {waiting} requests are waiting for the engine "
                f"(--max-waiting-requests {limit}); retry later."
            )

    def fail_all(self, error: Exception) -> None:
        """End every running request with ``error`` (raised from its `generate`), and abort it
        in the engine: the server's shutdown deadline."""
        for request_id, queue in list(self._streams.items()):
            self._abort(request_id)
            queue.put_error(error)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its `generate` stream ends with a finished output (reason "abort")."""
        queue = self._streams.get(request_id)
        output = self._abort(request_id)
        if queue is not None and output is not None:
            queue.put(output)

    def _abort(self, request_id: str) -> RequestOutput | None:
        """Forget the request here and free it in the engine (no await: callable from any finally)."""
        engine_ids = self._engine_ids.pop(request_id, None)
        self._streams.pop(request_id, None)
        if engine_ids is None:
            return None
        self._num_engine_requests -= len(engine_ids)
        outputs = self.output_processor.abort_requests([request_id])
        self.engine_core.abort_requests(engine_ids)
        if self.stat_loggers:  # reported now: no engine step may follow
            now = time.monotonic()
            timings = (self._timings.pop(engine_id, None) for engine_id in engine_ids)
            finished = [t.finished("abort", now) for t in timings if t is not None]
            if finished:
                self._record(None, IterationStats(finished=finished))
        return outputs[0] if outputs else None

    def _record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats) -> None:
        """Hand stats to every stat logger; a failing one is logged, never the request's error."""
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(scheduler_stats, iteration)
            except Exception:
                logger.exception("Stat logger %s failed", type(stat_logger).__name__)

    # ---------------------------------------------------------------- outputs (the client's task)

    def _on_outputs(self, msg: EngineStepOutputs) -> None:
        engine_outputs = msg.outputs
        results, to_abort = self.output_processor.process_outputs(engine_outputs)
        if to_abort:  # ended by a stop string, which only the front end sees
            self.engine_core.abort_requests(to_abort)
        iteration = self._iteration_stats(msg, results) if self.stat_loggers else None
        streams = self._streams
        for output in results:
            queue = streams.get(output.request_id)
            if queue is None:
                continue
            if not output.finished:
                queue.put(output)
                continue
            if any(c.finish_reason == _ERROR for c in output.outputs):
                logger.error("Request %s failed in the engine", output.request_id)
                queue.put_error(
                    RequestFailedError(
                        f"The request {output.request_id} failed in the engine "
                        "(its step raised; the server log has the details)."
                    )
                )
            else:
                queue.put(output)
            del streams[output.request_id]
            self._num_engine_requests -= len(self._engine_ids.pop(output.request_id))
        if iteration is not None:
            self._record(msg.scheduler_stats, iteration)

    def _iteration_stats(
        self, msg: EngineStepOutputs, results: list[RequestOutput]
    ) -> IterationStats:
        now = time.monotonic()
        stats = IterationStats()
        timings = self._timings
        for out in msg.outputs.outputs:
            timing = timings.get(out.request_id)
            num_new = len(out.new_token_ids)
            if timing is None or not num_new:
                continue
            stats.num_generation_tokens += num_new
            if timing.first_token is None:
                timing.first_token = now
                stats.ttfts_s.append(now - timing.arrival)
                stats.num_prompt_tokens += timing.num_prompt_tokens
            else:
                itl = now - timing.last_token
                stats.itls_s.append(itl)
                timing.itl_sum += itl
                timing.num_itls += 1
            timing.last_token = now
            timing.num_generation_tokens += num_new
        for output in results:
            if not output.finished:
                continue
            engine_ids = self._engine_ids.get(output.request_id, ())
            for completion in output.outputs:
                if completion.index < len(engine_ids):
                    timing = timings.pop(engine_ids[completion.index], None)
                    if timing is not None:
                        stats.finished.append(timing.finished(completion.finish_reason, now))
        return stats

    def _on_dead(self, error: EngineDeadError) -> None:
        streams, self._streams = self._streams, {}
        self._engine_ids.clear()
        self._num_engine_requests = 0
        for queue in streams.values():
            queue.put_error(error)

    def _start_background_tasks(self) -> None:
        self.engine_core.start_output_task()
        if not self.stat_loggers:
            return
        loop = asyncio.get_running_loop()
        task = self._log_task
        if task is None or task.done() or task.get_loop() is not loop:
            self._log_task = loop.create_task(self._log_periodically(), name="pagellm-stat-log")

    async def _log_periodically(self) -> None:
        while True:
            await asyncio.sleep(_LOG_INTERVAL_S)
            for stat_logger in self.stat_loggers:
                try:
                    stat_logger.log()
                except Exception:
                    logger.exception("Stat logger %s failed", type(stat_logger).__name__)

    # ---------------------------------------------------------------- engine utilities

    @property
    def errored(self) -> bool:
        return self.engine_core.errored

    def check_health(self) -> None:
        """Raise `EngineDeadError` if the engine process has exited or this front end lost track
        of it. Answered here, from the process's state: an engine busy with one long step is
        alive, and no probe has to wait for that step to end."""
        self.engine_core.raise_if_dead()

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.engine_core.call_utility("reset_prefix_cache"))

    async def get_engine_state(self) -> dict[str, Any]:
        """num_running, num_waiting, num_free_blocks, num_total_blocks (the null block excluded:
        all free when no request holds a block), kv_cache_usage, prefix_cache_hit_rate."""
        state: dict[str, Any] = await self.engine_core.call_utility("get_state")
        return state

    def shutdown(self) -> None:
        """Stop the engine process; requests still streaming raise `EngineDeadError`."""
        self._stop_log_task()
        self.engine_core.shutdown()
        self._on_dead(EngineDeadError("The engine was shut down."))

    async def shutdown_async(self, timeout: float) -> None:
        """`shutdown` without blocking the event loop: the engine gets ``timeout`` seconds to stop
        before it is killed."""
        self._stop_log_task()
        await self.engine_core.shutdown_async(timeout)
        self._on_dead(EngineDeadError("The engine was shut down."))

    def _stop_log_task(self) -> None:
        task = self._log_task
        if task is not None and not task.done() and not task.get_loop().is_closed():
            task.cancel()
