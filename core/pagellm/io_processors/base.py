"""`IOProcessor`: the contract of an IO processor plugin, and the error its input checks raise.

A request goes through four stages, all in the front end (the API server's process, or the
`LLM`'s):

1. `parse_request`: the raw request (a route's JSON body or one of its fields, an offline prompt
   dict) → the processor's typed input, or `IOProcessorInputError` (HTTP 400) when it is bad;
2. `pre_process`: typed input → engine prompts, what `LLM.generate` and `AsyncLLM.generate`
   take (token ids, text, and the model's multimodal items);
3. the engine runs the prompts;
4. `post_process`: the engine's outputs → the processor's typed result, and `output_to_response`:
   that result → a JSON-ready dict.

The ``*_async`` variants are what a server calls (on its event loop); by default they call the
synchronous stage. A processor whose stage does blocking work (decoding an image) overrides the
variant to move it off the loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from pagellm.config import EngineConfig
    from pagellm.engine.processor import PromptType

InputT = TypeVar("InputT")
OutputT = TypeVar("OutputT")


class IOProcessorInputError(ValueError):
    """A request an IO processor refuses (bad media, over a limit): the server answers HTTP 400
    with this message, naming ``param`` (the request field at fault) when it is known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class IOProcessor(ABC, Generic[InputT, OutputT]):
    """Built once per front end with the resolved engine config and its tokenizer (None when the
    engine runs without one). Stages must not keep per-request state on ``self``: requests run
    concurrently."""

    chat_placeholders: Mapping[str, str] = {}
    """The chat content part types it takes (OpenAI's ``image_url``) → the text each such part
    is rendered as in the prompt, where `pre_process` finds it again; a chat route hands the
    parts' media over as ``multi_modal_data``. Empty: it takes no media parts."""

    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer

    @abstractmethod
    def parse_request(self, request: Any) -> InputT:
        """The typed input of ``request``; raise `IOProcessorInputError` for bad input."""

    @abstractmethod
    def pre_process(self, data: InputT) -> list[PromptType]:
        """The engine prompts ``data`` runs as (one or more); `IOProcessorInputError` when they
        cannot be made (a prompt too long for the model, a placeholder without its item)."""

    def post_process(self, outputs: Sequence[Any], data: InputT) -> OutputT:
        """The typed result of the engine's final outputs, one per prompt of `pre_process` in
        its order. Default: the outputs as they are (a processor of input only)."""
        return list(outputs)  # type: ignore[return-value]

    def output_to_response(self, output: OutputT) -> dict[str, Any]:
        """``output`` as a JSON-ready dict. Default: each output's request id, prompt token ids
        and completions (text, token ids, finish reason), for results that are outputs."""
        return {
            "outputs": [
                {
                    "request_id": out.request_id,
                    "prompt_token_ids": out.prompt_token_ids,
                    "completions": [
                        {
                            "text": c.text,
                            "token_ids": list(c.token_ids),
                            "finish_reason": c.finish_reason,
                        }
                        for c in out.outputs
                    ],
                }
                for out in output  # type: ignore[attr-defined]
            ]
        }

    async def parse_request_async(self, request: Any) -> InputT:
        return self.parse_request(request)

    async def pre_process_async(self, data: InputT) -> list[PromptType]:
        return self.pre_process(data)

    async def post_process_async(self, outputs: Sequence[Any], data: InputT) -> OutputT:
        return self.post_process(outputs, data)
