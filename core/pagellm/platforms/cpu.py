"""The built-in CPU platform."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pagellm.platforms.interface import Platform

if TYPE_CHECKING:
    from pagellm.config import EngineConfig

_DEFAULT_KV_CACHE_FRACTION = 0.25
_DEFAULT_KV_CACHE_CAP = 4 << 30


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    # float32 first: the default for "auto" (reduced precision matmuls are slow on most CPUs).
    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)

    @classmethod
    def default_dtype(cls, model_dtype: torch.dtype | None) -> torch.dtype:
        return torch.float32

    @classmethod
    def attention_backend_ranking(cls) -> list[str]:
        return ["TORCH_SDPA"]

    @classmethod
    def available_kv_cache_memory(
        cls, config: EngineConfig, model_bytes: int, profile_run: Callable[[], None]
    ) -> int:
        """``kv_cache_memory`` bytes, else a quarter of RAM capped at 4 GiB."""
        if config.cache.kv_cache_memory is not None:
            return config.cache.kv_cache_memory
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return min(int(ram * _DEFAULT_KV_CACHE_FRACTION), _DEFAULT_KV_CACHE_CAP)
