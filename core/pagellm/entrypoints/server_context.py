"""What the API server hands its endpoint plugins: ``attach(app, ctx)`` gets a `ServerContext`
(plugin API 1.1; a 1.0 plugin gets ``attach(app, engine_client)``)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pagellm.config import EngineConfig
    from pagellm.engine.processor import PromptType
    from pagellm.entrypoints.server_args import ServerArgs
    from pagellm.io_processors import IOProcessor
    from pagellm.metrics.stats import StatLoggerBase
    from pagellm.outputs import EmbeddingRequestOutput, RequestOutput
    from pagellm.pooling_params import PoolingParams
    from pagellm.sampling_params import SamplingParams


class EngineClient(Protocol):
    """The engine as routes use it (`AsyncLLM`'s methods of the same names say more)."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer; None when the engine runs without one."""

    @property
    def io_processor(self) -> IOProcessor[Any, Any] | None:
        """The model's IO processor (``--io-processor``, else its config.json's
        ``io_processor_plugin``), or None; routes call its ``*_async`` stages."""

    def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs; ``ValueError`` for bad input before the first. Closing the
        generator aborts the request."""

    def encode(
        self, prompt: PromptType, params: PoolingParams, request_id: str, priority: int = 0
    ) -> AsyncGenerator[EmbeddingRequestOutput, None]:
        """A pooling request's output (its pooled vector), for a model served by the pooling
        runner; ``ValueError`` for bad input (or a generative model) before it."""

    async def abort(self, request_id: str) -> None: ...

    def check_health(self) -> None:
        """Raise `EngineDeadError` if the engine is gone; never waits for a step."""

    async def get_engine_state(self) -> dict[str, Any]: ...

    async def reset_prefix_cache(self) -> bool: ...


@dataclass(frozen=True)
class ServerContext:
    engine_client: EngineClient
    served_model_names: list[str]
    """The names clients may ask for; the first is the one reported."""
    model_path: str
    platform_name: str
    """The platform the engine runs on, as PAGELLM_PLATFORM names it (``cpu``, ``cuda``, ...)."""
    stat_loggers: list[StatLoggerBase]
    """The stat loggers the engine reports to (the built-in ones first)."""
    args: ServerArgs
    """Every ``pagellm serve`` option (``max_sequences_per_request``, ...)."""
