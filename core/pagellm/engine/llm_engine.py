"""`LLMEngine`: the offline front end — the shared request path (`RequestFrontend`) over an engine
core stepped by the caller.

The engine core runs in this process by default; with ``EngineArgs.multiprocess_engine`` it runs
in a background process driven through `SyncMPClient` (the same protocol `AsyncLLM` uses).
"""

from __future__ import annotations

from collections.abc import Iterable

from pagellm.config import EngineConfig
from pagellm.engine.args import EngineArgs
from pagellm.engine.core import EngineCore
from pagellm.engine.core_client import EngineCoreClient, SyncMPClient
from pagellm.engine.processor import ProcessedPrompt, PromptType
from pagellm.engine.request_frontend import RequestFrontend
from pagellm.outputs import AnyRequestOutput
from pagellm.plugins import load_general_plugins
from pagellm.sampling_params import SamplingParams


class LLMEngine(RequestFrontend):
    core_client: EngineCoreClient

    def __init__(self, config: EngineConfig, multiprocess_engine: bool = False) -> None:
        """``multiprocess_engine``: run the engine core in a process of its own (it gets
        ``config``)."""
        super().__init__(config)
        self._engine_core: EngineCore | None = None
        if multiprocess_engine:
            self.core_client = SyncMPClient(config)
        else:
            self._engine_core = self.core_client = EngineCore(config)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        load_general_plugins()  # out-of-tree models must be known before the config is checked
        return cls(args.create_engine_config(), args.multiprocess_engine)

    @property
    def engine_core(self) -> EngineCore:
        """The in-process engine core (its scheduler, KV cache manager, executor)."""
        if self._engine_core is None:
            raise RuntimeError(
                "The engine core runs in another process (multiprocess_engine=True); "
                "its internals are not reachable from here."
            )
        return self._engine_core

    def add_request(
        self,
        request_id: str,
        prompt: PromptType | ProcessedPrompt,
        params: SamplingParams | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request. A prompt that ``processor.process`` returned is not tokenized again
        and runs with its own parameters; any other runs with ``params`` (default
        `SamplingParams()` with the model's generation config defaults)."""
        if not isinstance(prompt, ProcessedPrompt):
            if params is None:
                params = SamplingParams(**self.config.model.default_sampling)
            prompt = self.processor.process(prompt, params)
        self._add_request(request_id, prompt, priority)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[AnyRequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        return self._abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests)

    def step(self) -> list[AnyRequestOutput]:
        if not self.has_unfinished_requests():
            return []  # a separate engine process would have no step to send: do not wait for one
        return self._process_outputs(self.core_client.step())

    def shutdown(self) -> None:
        self.core_client.shutdown()
