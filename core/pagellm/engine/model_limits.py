"""The model's dtype and length limit as the engine arguments resolve them (`EngineArgs`)."""

from __future__ import annotations

import typing
from typing import Any

import torch

from pagellm.config import DTYPES, ConfigError, DTypeName, ModelConfig

_DTYPE_ALIASES: dict[str, DTypeName] = {
    "float": "float32",
    "half": "float16",
    "fp32": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
}


def resolve_dtype(dtype: str, hf_config: Any, platform: Any) -> DTypeName:
    """``dtype`` (``auto``, a name or an alias) as a dtype name the platform supports."""
    names = {d: name for name, d in DTYPES.items()}
    if dtype == "auto":
        declared = getattr(hf_config, "dtype", None)
        if isinstance(declared, str):
            declared = getattr(torch, declared, None)
        return names[platform.default_dtype(declared)]
    requested = _DTYPE_ALIASES.get(dtype) or typing.cast(DTypeName, dtype)
    if DTYPES[requested] not in platform.supported_dtypes:
        supported = [names[d] for d in platform.supported_dtypes]
        raise ConfigError(
            f"dtype={dtype!r} is not supported on {platform.name}; use auto or one of {supported}."
        )
    return requested


def resolve_max_model_len(max_model_len: int | None, model_cfg: ModelConfig) -> int:
    """The requested ``max_model_len``, or the model's ``max_position_embeddings``; never above it."""
    limit = getattr(model_cfg.text_config, "max_position_embeddings", None)
    if max_model_len is None:
        if limit is None:
            raise ConfigError(
                "The model config has no max_position_embeddings; pass max_model_len."
            )
        return int(limit)
    if limit is not None and max_model_len > limit:
        raise ConfigError(
            f"max_model_len={max_model_len} is larger than the model's "
            f"max_position_embeddings={limit}."
        )
    return max_model_len
