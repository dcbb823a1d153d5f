"""`LLMEngine`: the in-process engine — input processing, the engine core, output processing."""

from __future__ import annotations

from collections.abc import Iterable

from pagellm.config import EngineConfig
from pagellm.engine.args import EngineArgs
from pagellm.engine.core import EngineCore
from pagellm.engine.output_processor import OutputProcessor
from pagellm.engine.processor import InputProcessor, PromptType
from pagellm.outputs import RequestOutput
from pagellm.plugins import load_frontend_plugins, load_general_plugins
from pagellm.sampling_params import SamplingParams
from pagellm.tokenizer import get_tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        load_general_plugins()
        load_frontend_plugins()
        self.config = config
        self.tokenizer = get_tokenizer(config.model.tokenizer)
        self.processor = InputProcessor(config, self.tokenizer)
        self.engine_core = EngineCore(config)
        self.output_processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        load_general_plugins()  # out-of-tree models must be known before the config is checked
        return cls(args.create_engine_config())

    def validate_request(self, prompt: PromptType, params: SamplingParams) -> None:
        """Raise ValueError for a request that `add_request` would refuse, changing nothing."""
        self.processor.process("validation", prompt, params)

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
        text, request = self.processor.process(request_id, prompt, params, priority, cache_salt)
        self.engine_core.add_request(request)
        self.output_processor.add_request(
            request_id, text, request.prompt_token_ids, request.sampling_params
        )

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.engine_core.abort_requests(ids)
        return self.output_processor.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        return self.output_processor.process_outputs(self.engine_core.step())
