"""The `Platform` interface: what the core asks of a kind of hardware."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from pagellm.config import EngineConfig


class Platform:
    name: ClassVar[str]
    device_type: ClassVar[str]
    """torch device type: "cpu", "cuda", ..."""
    dist_backend: ClassVar[str] = "gloo"
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)

    @classmethod
    def device(cls, local_rank: int = 0) -> torch.device:
        return torch.device(cls.device_type)

    @classmethod
    def default_dtype(cls, model_dtype: torch.dtype | None) -> torch.dtype:
        """The dtype used for ``dtype="auto"``, given the one the checkpoint declares."""
        if model_dtype in cls.supported_dtypes:
            return model_dtype
        return cls.supported_dtypes[0]

    @classmethod
    def attention_backend_ranking(cls) -> list[str]:
        """Preferred attention backends, best first (only installed ones are considered)."""
        return []

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> None:
        """Last look at the finished config (e.g. pick defaults the hardware needs)."""

    @classmethod
    def total_memory(cls) -> int:
        raise NotImplementedError

    @classmethod
    def available_kv_cache_memory(cls, config: EngineConfig, model_bytes: int) -> int:
        """Bytes the KV cache may take on this device once the model is loaded."""
        raise NotImplementedError

    @classmethod
    def seed_everything(cls, seed: int) -> None:
        torch.manual_seed(seed)

    @classmethod
    def synchronize(cls) -> None:
        pass
