"""`EmbeddingsProcessor`: OpenAI embeddings requests → pooling prompts → OpenAI's response.

- `parse_request`: the body (an `EmbeddingRequest` or its dict) → `EmbeddingsInput`; the input's
  shape is checked item by item (400 naming ``input``), ``dimensions`` refused;
- `pre_process`: one engine prompt per item (a text, or token ids), which the engine tokenizes,
  truncates when asked, and checks against ``max_model_len`` (`AsyncLLM.encode`);
- `post_process`: the engine's `EmbeddingRequestOutput`s → the vectors and the prompt tokens;
- `output_to_response`: OpenAI's ``{"object": "list", "data": [...], "model", "usage"}``, the
  vectors as numbers or as base64 of their float32 little-endian bytes.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import ValidationError

from pagellm.config import EngineConfig
from pagellm.engine.processor import PromptType
from pagellm.io_processors import IOProcessor, IOProcessorInputError
from pagellm.outputs import EmbeddingRequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParamsError
from pagellm_io_embeddings.protocol import EmbeddingRequest, EmbeddingsInput, EmbeddingsResult


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _items(raw: Any) -> list[str | list[int]]:
    """The input's items: a string or a list of token ids on its own is one item; a list holds
    strings or token-id lists, not both."""
    if raw == []:
        raise IOProcessorInputError("input is an empty list.", "input")
    if isinstance(raw, str) or (isinstance(raw, list) and all(_is_token_id(t) for t in raw)):
        raw = [raw]
    if not isinstance(raw, list):
        raise IOProcessorInputError(
            "input must be a string, a list of strings, a list of token ids or a list of "
            f"token-id lists, not {type(raw).__name__}.",
            "input",
        )
    texts = isinstance(raw[0], str)
    for i, item in enumerate(raw):
        if texts and isinstance(item, str):
            if not item:
                raise IOProcessorInputError(f"input[{i}] is an empty string.", "input")
        elif not texts and isinstance(item, list) and all(_is_token_id(t) for t in item):
            if not item:
                raise IOProcessorInputError(f"input[{i}] is an empty list of token ids.", "input")
        elif i == 0:
            raise IOProcessorInputError(
                "input[0] must be a string or a list of token ids.", "input"
            )
        else:
            what = "a string" if texts else "a list of token ids"
            raise IOProcessorInputError(
                f"input[{i}] must be {what}, as input[0] is (an input list holds strings or "
                "token-id lists, not both).",
                "input",
            )
    return raw


class EmbeddingsProcessor(IOProcessor[EmbeddingsInput, EmbeddingsResult]):
    """For a model served by the pooling runner (``config.model.pooler``)."""

    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        if config.model.pooler is None:
            raise ValueError(
                f"The embeddings IO processor needs a model served by the pooling runner; "
                f"{config.model.architecture} runs with runner {config.model.runner!r}."
            )
        super().__init__(config, tokenizer)

    def parse_request(self, request: Any) -> EmbeddingsInput:
        if not isinstance(request, EmbeddingRequest):
            try:
                request = EmbeddingRequest.model_validate(request)
            except ValidationError as exc:
                error = exc.errors()[0]
                field = ".".join(str(part) for part in error["loc"]) or None
                raise IOProcessorInputError(f"{field}: {error['msg']}", field) from None
        if request.dimensions is not None:
            raise IOProcessorInputError(
                f"dimensions={request.dimensions} is not supported: "
                f"{self.config.model.architecture} has no Matryoshka dimensions; omit dimensions "
                "to get its full vectors.",
                "dimensions",
            )
        try:
            params = PoolingParams(
                truncate_prompt_tokens=request.truncate_prompt_tokens,
                normalize=request.normalize,
            )
        except SamplingParamsError as exc:
            raise IOProcessorInputError(str(exc), exc.param) from None
        prompts: list[PromptType] = [
            {"prompt": item} if isinstance(item, str) else {"prompt_token_ids": item}
            for item in _items(request.input)
        ]
        return EmbeddingsInput(prompts, params, request.encoding_format, request.model)

    def pre_process(self, data: EmbeddingsInput) -> list[PromptType]:
        return data.prompts

    def post_process(
        self, outputs: Sequence[EmbeddingRequestOutput], data: EmbeddingsInput
    ) -> EmbeddingsResult:
        return EmbeddingsResult(
            vectors=[output.outputs.embedding for output in outputs],
            prompt_tokens=sum(len(output.prompt_token_ids) for output in outputs),
            encoding_format=data.encoding_format,
            model=data.model,
        )

    def output_to_response(self, output: EmbeddingsResult) -> dict[str, Any]:
        data = []
        for index, vector in enumerate(output.vectors):
            embedding: list[float] | str = vector
            if output.encoding_format == "base64":
                raw = np.asarray(vector, dtype="<f4").tobytes()
                embedding = base64.b64encode(raw).decode("ascii")
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        tokens = output.prompt_tokens
        return {
            "object": "list",
            "data": data,
            "model": output.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
