"""`RequestFrontend`: the request path `LLMEngine` and `AsyncLLM` share. A request is tokenized
and validated once (`InputProcessor`), fanned out into one engine request per completion, sent to
the engine core, and followed by the `OutputProcessor` until it ends or is aborted. The model's IO
processor, if it has one (`pagellm.io_processors`), is built here: the front end is the only
place one runs."""

from __future__ import annotations

from typing import Any

from pagellm.config import EngineConfig
from pagellm.engine.core_client import RequestSink
from pagellm.engine.errors import EngineOverloadedError
from pagellm.engine.output_processor import OutputProcessor
from pagellm.engine.processor import InputProcessor, ProcessedPrompt, fan_out
from pagellm.io_processors import IOProcessor, build_io_processor
from pagellm.outputs import AnyRequestOutput
from pagellm.plugins import load_frontend_plugins, load_general_plugins
from pagellm.scheduler.output import EngineCoreOutputs
from pagellm.tokenizer import get_tokenizer


class RequestFrontend:
    core_client: RequestSink
    """Set by the subclass: the engine core (in process) or its client."""

    def __init__(self, config: EngineConfig, max_waiting_requests: int | None = None) -> None:
        """``max_waiting_requests``: engine requests (one per completion) allowed to wait for the
        engine beyond those it runs; more raise `EngineOverloadedError` (None: no limit)."""
        load_general_plugins()
        load_frontend_plugins()
        self.config = config
        self.tokenizer = (
            None
            if config.model.skip_tokenizer_init
            else get_tokenizer(config.model.tokenizer, config.model.trust_remote_code)
        )
        self.io_processor: IOProcessor[Any, Any] | None = build_io_processor(config, self.tokenizer)
        """The model's IO processor (``config.model.io_processor``), or None."""
        self.processor = InputProcessor(config, self.tokenizer, self.io_processor)
        self.output_processor = OutputProcessor(self.tokenizer, config.scheduler.stream_interval)
        self.max_waiting_requests = max_waiting_requests

    def _add_request(self, request_id: str, prompt: ProcessedPrompt, priority: int) -> list[str]:
        """Send the request's engine requests and follow them; returns their ids."""
        engine_requests = fan_out(request_id, prompt.params)
        followed = self.output_processor
        # An n > 1 request's engine ids ("0_x", ...) may be another request's own id: refused too,
        # or the engine's outputs would reach the wrong request.
        if request_id in followed.requests or any(
            engine_id in followed.engine_to_request for engine_id, _ in engine_requests
        ):
            raise ValueError(f"A request with id {request_id!r} is already running.")
        requests = self.processor.make_requests(prompt, engine_requests, priority)
        self._check_capacity(len(requests))
        self.output_processor.add_request(request_id, prompt, engine_requests)
        try:
            for request in requests:
                self.core_client.add_request(request)
        except BaseException:
            self._abort_requests([request_id])
            raise
        return [engine_id for engine_id, _ in engine_requests]

    def _check_capacity(self, num_new: int) -> None:
        limit = self.max_waiting_requests
        if limit is None:
            return
        # Submitted and unfinished beyond what the engine can run at once (up to max_num_seqs):
        # they wait. (When the KV cache, not max_num_seqs, limits the running requests, the
        # queue is longer by that difference: still bounded.)
        submitted = len(self.output_processor.engine_to_request)
        waiting = max(0, submitted - self.config.scheduler.max_num_seqs)
        if waiting + num_new > limit:
            raise EngineOverloadedError(
                f"The server is overloaded: {waiting} requests are waiting for the engine "
                f"(--max-waiting-requests {limit}); retry later."
            )

    def _abort_requests(self, request_ids: list[str]) -> list[AnyRequestOutput]:
        """Free the requests in the engine and stop following them; their final outputs (none
        for a request that is not running)."""
        output_processor = self.output_processor
        engine_ids = [e for r in request_ids for e in output_processor.engine_ids(r)]
        self.core_client.abort_requests(engine_ids)
        return output_processor.abort_requests(request_ids)

    def _process_outputs(self, engine_outputs: EngineCoreOutputs) -> list[AnyRequestOutput]:
        results, to_abort = self.output_processor.process_outputs(engine_outputs)
        if to_abort:  # ended by a stop string, which only the front end sees
            self.core_client.abort_requests(to_abort)
        return results
