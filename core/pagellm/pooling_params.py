"""Parameters of one pooling request (vLLM's ``PoolingParams``), validated when constructed.

A pooling request runs once over its whole prompt: no sampling, no decode. The engine core
returns the model's pooled vector (`PoolerConfig`: mean, CLS or last token); the front end
L2-normalizes it when ``normalize`` says so.
"""

from __future__ import annotations

import msgspec

from pagellm.sampling_params import SamplingParamsError

POOLING_TASKS = ("embed",)
"""The pooling tasks a request may ask for."""


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    task: str = "embed"
    truncate_prompt_tokens: int | None = None
    """Keep only this many prompt tokens (-1: ``max_model_len``): a text is cut by its tokenizer
    (on the tokenizer's truncation side, special tokens kept), token ids keep their last ones."""
    normalize: bool | None = None
    """L2-normalize the pooled vector; None: as the model's pooler config says."""
    dimensions: int | None = None
    """Matryoshka output size: refused, as no served model declares Matryoshka dimensions."""

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise SamplingParamsError(
                "task", f"task must be one of {list(POOLING_TASKS)}, got {self.task!r}."
            )
        keep = self.truncate_prompt_tokens
        if keep is not None and (
            isinstance(keep, bool) or not isinstance(keep, int) or (keep < 1 and keep != -1)
        ):
            raise SamplingParamsError(
                "truncate_prompt_tokens",
                f"truncate_prompt_tokens must be -1 or a positive integer, got {keep!r}.",
            )
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool)
            or not isinstance(self.dimensions, int)
            or self.dimensions < 1
        ):
            raise SamplingParamsError(
                "dimensions", f"dimensions must be a positive integer, got {self.dimensions!r}."
            )
