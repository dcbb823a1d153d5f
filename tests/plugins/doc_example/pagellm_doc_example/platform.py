# pagellm_doc_example/platform.py
"""PlainCpuPlatform: pagellm on the CPU under a platform of its own, preferring PLAIN_TORCH."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pagellm.platforms.interface import Platform

if TYPE_CHECKING:
    from pagellm.config import EngineConfig

DEFAULT_KV_CACHE_BYTES = 256 << 20


class PlainCpuPlatform(Platform):
    name = "plain_cpu"
    device_type = "cpu"
    supported_dtypes = (torch.float32, torch.bfloat16)

    @classmethod
    def default_dtype(cls, model_dtype: torch.dtype | None) -> torch.dtype:
        # What dtype="auto" runs in, whatever the checkpoint declares: CPUs are slow at bfloat16.
        return torch.float32

    @classmethod
    def attention_backend_ranking(cls) -> list[str]:
        return ["PLAIN_TORCH", "TORCH_SDPA"]

    @classmethod
    def available_kv_cache_memory(
        cls, config: EngineConfig, model_bytes: int, profile_run: Callable[[], None]
    ) -> int:
        # A GPU platform would call profile_run() and measure its peak memory; the CPU has no
        # such counter, so the cache gets what the user asked for, or a fixed budget.
        return config.cache.kv_cache_memory or DEFAULT_KV_CACHE_BYTES
