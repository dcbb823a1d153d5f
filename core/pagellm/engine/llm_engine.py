"""`LLMEngine`: the offline front end — input processing, the engine core, output processing.

The engine core runs in this process by default; with ``EngineArgs.multiprocess_engine`` it runs
in a background process driven through `SyncMPClient` (the same protocol `AsyncLLM` uses).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from pagellm.config import EngineConfig
from pagellm.engine.args import EngineArgs
from pagellm.engine.core import EngineCore
from pagellm.engine.core_client import EngineCoreClient, SyncMPClient
from pagellm.engine.output_processor import OutputProcessor
from pagellm.engine.processor import InputProcessor, PromptType
from pagellm.outputs import RequestOutput
from pagellm.plugins import load_frontend_plugins, load_general_plugins
from pagellm.sampling_params import SamplingParams
from pagellm.tokenizer import get_tokenizer


def child_params(params: SamplingParams) -> list[SamplingParams]:
    """A request with n > 1 runs as n engine requests; with a seed, completion i uses seed + i,
    so each is reproducible on its own and independent of the batch."""
    if params.n == 1:
        return [params]
    return [
        msgspec.structs.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
        for i in range(params.n)
    ]


def engine_request_ids(request_id: str, n: int) -> list[str]:
    """The engine requests a user request runs as: itself, or ``"{i}_{request_id}"`` for n > 1."""
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


class LLMEngine:
    def __init__(self, config: EngineConfig, multiprocess_engine: bool = False) -> None:
        """``multiprocess_engine``: run the engine core in a process of its own (it gets
        ``config``)."""
        load_general_plugins()
        load_frontend_plugins()
        self.config = config
        self.tokenizer = (
            None if config.model.skip_tokenizer_init else get_tokenizer(config.model.tokenizer)
        )
        self.processor = InputProcessor(config, self.tokenizer)
        self._engine_core: EngineCore | None = None
        self.core_client: EngineCoreClient
        if multiprocess_engine:
            self.core_client = SyncMPClient(config)
        else:
            self._engine_core = self.core_client = EngineCore(config)
        self.output_processor = OutputProcessor(self.tokenizer)

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

    def validate_request(self, prompt: PromptType, params: SamplingParams) -> None:
        """Raise ValueError for a request that `add_request` would refuse, changing nothing."""
        self.processor.process(prompt, params)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        if request_id in self.output_processor.requests:
            raise ValueError(f"A request with id {request_id!r} is already in the engine.")
        processed = self.processor.process(prompt, params)
        children = child_params(processed.params)
        engine_ids = engine_request_ids(request_id, len(children))
        requests = [
            self.processor.make_request(engine_id, processed, cparams, priority, cache_salt)
            for engine_id, cparams in zip(engine_ids, children, strict=True)
        ]
        self.output_processor.add_request(
            request_id, processed.text, processed.token_ids, processed.params, engine_ids, children
        )
        for request in requests:
            self.core_client.add_request(request)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        engine_ids = [e for r in ids for e in self.output_processor.engine_ids(r)]
        self.core_client.abort_requests(engine_ids)
        return self.output_processor.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        if not self.output_processor.has_unfinished_requests():
            return []  # a separate engine process would have no step to send: do not wait for one
        outputs, to_abort = self.output_processor.process_outputs(self.core_client.step())
        if to_abort:
            self.core_client.abort_requests(to_abort)
        return outputs

    def shutdown(self) -> None:
        self.core_client.shutdown()
