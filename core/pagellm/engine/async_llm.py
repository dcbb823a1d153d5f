"""`AsyncLLM`: the asyncio front end (the API server's engine client).

The engine core runs in its own process (`AsyncMPClient`); this process runs the request path it
shares with `LLMEngine` (`RequestFrontend`: tokenization, validation, the ``n > 1`` fan-out,
detokenization, stop strings, output kinds), one `RequestOutputCollector` per request fed by the
client's output task, and the stats handed to the stat loggers (`RequestTimings`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, cast

from pagellm.config import EngineConfig
from pagellm.engine.args import EngineArgs
from pagellm.engine.async_core_client import AsyncMPClient
from pagellm.engine.errors import EngineDeadError, RequestFailedError
from pagellm.engine.messages import EngineStepOutputs
from pagellm.engine.output_collector import RequestOutputCollector
from pagellm.engine.processor import ProcessedPrompt, PromptType
from pagellm.engine.request_frontend import RequestFrontend
from pagellm.engine.request_timing import RequestTimings
from pagellm.metrics.stats import IterationStats, SchedulerStats, StatLoggerBase
from pagellm.outputs import AnyRequestOutput, EmbeddingRequestOutput, RequestOutput
from pagellm.plugins import load_general_plugins
from pagellm.pooling_params import PoolingParams
from pagellm.request import FinishReason
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_LOG_INTERVAL_S = 5.0
_ERROR = str(FinishReason.ERROR)


class AsyncLLM(RequestFrontend):
    core_client: AsyncMPClient

    def __init__(
        self,
        config: EngineConfig,
        stat_loggers: list[StatLoggerBase] | None = None,
        max_waiting_requests: int | None = None,
        log_requests: bool = False,
    ) -> None:
        super().__init__(config, max_waiting_requests)
        self.stat_loggers = list(stat_loggers or [])
        self.log_requests = log_requests
        self._streams: dict[str, RequestOutputCollector] = {}
        self._timings = RequestTimings()
        self._log_task: asyncio.Task[None] | None = None
        self.core_client = AsyncMPClient(config, self._on_outputs, self._on_dead)
        num_gpu_blocks = self.core_client.ready.num_blocks
        self._each_stat_logger(lambda s: s.log_engine_initialized(config, num_gpu_blocks))

    @classmethod
    def from_engine_args(
        cls,
        args: EngineArgs,
        stat_loggers: list[StatLoggerBase] | None = None,
        max_waiting_requests: int | None = None,
        log_requests: bool = False,
    ) -> AsyncLLM:
        load_general_plugins()  # out-of-tree models must be known before the config is checked
        return cls(args.create_engine_config(), stat_loggers, max_waiting_requests, log_requests)

    # ---------------------------------------------------------------- requests

    def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's outputs (in ``params.output_kind``), the last one finished.

        Bad input raises ``ValueError`` (when the stream is first read) before anything is
        queued; more requests than ``max_waiting_requests`` allows raise
        `EngineOverloadedError`. If the consumer stops iterating or is cancelled, the request is
        aborted in the engine (its KV blocks freed). Raises `EngineDeadError` if the engine
        process dies.
        """
        outputs = self._run(lambda: self.processor.process(prompt, params), request_id, priority)
        return cast(AsyncGenerator[RequestOutput, None], outputs)

    def encode(
        self, prompt: PromptType, params: PoolingParams, request_id: str, priority: int = 0
    ) -> AsyncGenerator[EmbeddingRequestOutput, None]:
        """A pooling request's one output (its pooled vector): as `generate`, for a model
        served by the pooling runner."""
        outputs = self._run(
            lambda: self.processor.process_pooling(prompt, params), request_id, priority
        )
        return cast(AsyncGenerator[EmbeddingRequestOutput, None], outputs)

    async def _run(
        self, process: Callable[[], ProcessedPrompt], request_id: str, priority: int
    ) -> AsyncGenerator[AnyRequestOutput, None]:
        """Process the prompt, send the request and stream its outputs; aborted if the consumer
        stops. The one generator between the collector and the consumer: a stream's tokens
        pass through no other layer here."""
        arrival = time.monotonic()  # the metrics' latencies include the tokenization
        self.core_client.raise_if_dead()
        processed = process()
        self._start_background_tasks()
        engine_ids = self._add_request(request_id, processed, priority)
        if self.log_requests:
            logger.info(
                "Added request %s: %d prompt tokens, priority %d, %r",
                request_id,
                len(processed.token_ids),
                priority,
                processed.params,
            )
        queue = self._streams[request_id] = RequestOutputCollector(processed.params.output_kind)
        if self.stat_loggers:
            self._timings.start(
                request_id,
                engine_ids,
                len(processed.token_ids),
                processed.params.max_tokens,
                arrival,
            )
        finished = False
        try:
            while not finished:
                waiter = queue.wait()
                if waiter is not None:
                    await waiter
                item = queue.take()
                if isinstance(item, Exception):
                    raise type(item)(*item.args)  # one instance per request: its own traceback
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._abort(request_id)

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

    def _abort(self, request_id: str) -> AnyRequestOutput | None:
        """Forget the request here and free it in the engine (no await: callable from any finally)."""
        self._streams.pop(request_id, None)
        outputs = self._abort_requests([request_id])
        if self.log_requests and outputs:
            logger.info("Aborted request %s.", request_id)
        stats = self._timings.abort(request_id)
        if stats is not None:  # reported now: no engine step may follow
            self._record(None, stats)
        return outputs[0] if outputs else None

    def _record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats) -> None:
        self._each_stat_logger(lambda s: s.record(scheduler_stats, iteration))

    def _each_stat_logger(self, call: Callable[[StatLoggerBase], None]) -> None:
        """A failing stat logger is logged, never the request's error."""
        for stat_logger in self.stat_loggers:
            try:
                call(stat_logger)
            except Exception:
                logger.exception("Stat logger %s failed", type(stat_logger).__name__)

    # ---------------------------------------------------------------- outputs (the client's task)

    def _on_outputs(self, msg: EngineStepOutputs) -> None:
        results = self._process_outputs(msg.outputs)
        iteration = self._timings.step(msg.outputs, results) if self.stat_loggers else None
        streams = self._streams
        for output in results:
            queue = streams.get(output.request_id)
            if queue is None:
                continue
            if not output.finished:
                queue.put(output)
                continue
            del streams[output.request_id]
            if _failed(output):
                logger.error("Request %s failed in the engine", output.request_id)
                queue.put_error(
                    RequestFailedError(
                        f"The request {output.request_id} failed in the engine "
                        "(its step raised; the server log has the details)."
                    )
                )
            else:
                queue.put(output)
        if iteration is not None:
            self._record(msg.scheduler_stats, iteration)

    def _on_dead(self, error: EngineDeadError) -> None:
        streams, self._streams = self._streams, {}
        self.output_processor.abort_requests(list(self.output_processor.requests))
        for queue in streams.values():
            queue.put_error(error)

    def _start_background_tasks(self) -> None:
        self.core_client.start_output_task()
        if not self.stat_loggers:
            return
        loop = asyncio.get_running_loop()
        task = self._log_task
        if task is None or task.done() or task.get_loop() is not loop:
            self._log_task = loop.create_task(self._log_periodically(), name="pagellm-stat-log")

    async def _log_periodically(self) -> None:
        while True:
            await asyncio.sleep(_LOG_INTERVAL_S)
            self._each_stat_logger(lambda s: s.log())

    # ---------------------------------------------------------------- engine utilities

    @property
    def errored(self) -> bool:
        return self.core_client.errored

    def check_health(self) -> None:
        """Raise `EngineDeadError` if the engine process has exited or this front end lost track
        of it. Answered here, from the process's state: an engine busy with one long step is
        alive, and no probe has to wait for that step to end."""
        self.core_client.raise_if_dead()

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.core_client.call_utility("reset_prefix_cache"))

    async def get_engine_state(self) -> dict[str, Any]:
        """num_running, num_waiting, num_free_blocks, num_total_blocks (the null block excluded:
        all free when no request holds a block), kv_cache_usage, prefix_cache_hit_rate."""
        return await self.core_client.call_utility("get_state")

    def shutdown(self) -> None:
        """Stop the engine process; requests still streaming raise `EngineDeadError`."""
        task = self._log_task
        if task is not None and not task.done() and not task.get_loop().is_closed():
            task.cancel()
        self.core_client.shutdown()
        self._on_dead(EngineDeadError("The engine was shut down."))

    async def shutdown_async(self, timeout: float) -> None:
        """`shutdown` without blocking the event loop: the engine gets ``timeout`` seconds to stop
        before it is killed."""
        await self.core_client.shutdown_async(timeout)
        self.shutdown()  # the engine is stopped: what is left is ending the streams


def _failed(output: AnyRequestOutput) -> bool:
    """Whether the engine failed the request (its step raised)."""
    if isinstance(output, EmbeddingRequestOutput):
        return output.finish_reason == _ERROR
    return any(c.finish_reason == _ERROR for c in output.outputs)
