"""`RocmPlatform`: pagellm on AMD GPUs through PyTorch's ROCm build.

A ROCm build of torch speaks ``torch.cuda`` (HIP behind it), NCCL's API (RCCL behind it) and
CUDA graphs (HIP graphs behind them), so this platform is the CUDA platform's code where the two
agree: memory profiling for the KV cache, decode graphs, the side-stream host copy, event timing
and the fused Triton kernels are `CudaPlatform`'s. What differs is decided here: detection
(`pagellm_rocm.detection`), the visible-device variables (`pagellm_rocm.visible`), device facts
from the gfx architecture (`pagellm_rocm.arch`), the dtype for ``dtype="auto"``, the fp8 format and
the attention ranking (`pagellm_rocm.attention`).

It has never run on AMD hardware. The rules are plain functions tested on the CPU; the methods
that call into ``torch.cuda`` run only on an AMD GPU.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
from pagellm_cuda.platform import CudaPlatform

from pagellm.config import ConfigError, EngineConfig
from pagellm_rocm.arch import GfxArch, parse_arch
from pagellm_rocm.attention import attention_ranking
from pagellm_rocm.detection import detect, physical_gpus
from pagellm_rocm.visible import physical_device_id, visible_device_id

logger = logging.getLogger(__name__)


def auto_dtype(model_dtype: torch.dtype | None, arch: GfxArch) -> torch.dtype:
    """The dtype for ``dtype="auto"`` on ``arch``: as on CUDA, a float16 checkpoint stays
    float16; everything else runs in bfloat16 where the GPU has bfloat16 matrix instructions,
    else in float16."""
    if model_dtype == torch.float16 or not arch.has_bf16:
        return torch.float16
    return torch.bfloat16


@functools.cache
def _ranking() -> list[str]:
    ranking, left_out = attention_ranking()
    for name, reason in left_out.items():
        logger.info("Attention backend %s not ranked on ROCm: %s.", name, reason)
    return ranking


class RocmPlatform(CudaPlatform):
    name = "rocm"
    device_type = "cuda"  # torch's device type on ROCm builds too
    # Every dtype torch computes in; bfloat16 without matrix instructions (RDNA1/2, GCN5) is
    # emulated, so "auto" avoids it there (`auto_dtype`) and an explicit --dtype bfloat16 is slow.
    supported_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    dist_backend = "nccl"  # RCCL, under NCCL's name
    # Measured on NVIDIA only; off until measured on an AMD GPU (--async-scheduling turns it on).
    async_scheduling_default = False

    # ------------------------------------------------------------------ devices (GPU only)

    @classmethod
    def _num_physical(cls) -> int:
        gpus = physical_gpus()
        return 0 if isinstance(gpus, str) else len(gpus.archs)

    @classmethod
    def device(cls, local_rank: int = 0) -> torch.device:
        """The worker's GPU, made the process's current device (see `CudaPlatform.device`)."""
        index = visible_device_id(local_rank, os.environ, cls._num_physical())
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    @classmethod
    def device_count(cls) -> int | None:
        """The visible AMD GPUs (the visible-device variables applied), counted without HIP."""
        return len(detect().physical)

    @classmethod
    def _index(cls, device_id: int | None) -> int:
        if device_id is None:
            return torch.cuda.current_device()
        return visible_device_id(device_id, os.environ, cls._num_physical())

    @classmethod
    def physical_device_id(cls, local_rank: int) -> int | str:
        """The id ``amd-smi`` knows the worker's GPU by (after ``ROCR_VISIBLE_DEVICES`` and
        ``HIP_VISIBLE_DEVICES``)."""
        return physical_device_id(local_rank, os.environ, cls._num_physical())

    @classmethod
    def gfx_arch(cls, device_id: int | None = None) -> GfxArch:
        """The architecture of a visible GPU (``device_id`` logical, None: the current one):
        from amdsmi or sysfs when they named it (no HIP initialisation), else from torch."""
        if device_id is not None:
            archs = detect().archs
            if 0 <= device_id < len(archs) and archs[device_id]:
                return parse_arch(archs[device_id])
        return parse_arch(torch.cuda.get_device_properties(cls._index(device_id)).gcnArchName)

    @classmethod
    def device_capability(cls, device_id: int | None = None) -> tuple[int, int]:
        """(major, minor) of the gfx architecture, e.g. (9, 4) for gfx942 (MI300X)."""
        return cls.gfx_arch(device_id).capability

    # ------------------------------------------------------------------ configuration

    @classmethod
    def default_dtype(cls, model_dtype: torch.dtype | None) -> torch.dtype:
        """See `auto_dtype`; asks GPU 0's architecture (amdsmi or sysfs, else torch)."""
        return auto_dtype(model_dtype, cls.gfx_arch(0))

    @classmethod
    def fp8_dtype(cls) -> torch.dtype | None:
        """float8_e4m3fnuz on CDNA3 (gfx94x), float8_e4m3fn on CDNA4 and RDNA4, else None."""
        return cls.gfx_arch(0).fp8_dtype

    @classmethod
    def attention_backend_ranking(cls) -> list[str]:
        """``TRITON_ATTN``, then FlashAttention's and AITER's backends where their libraries
        import, then ``TORCH_SDPA`` (`pagellm_rocm.attention`); the others' reasons are logged."""
        return list(_ranking())

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> None:
        """As on CUDA (decode graphs, which torch records as HIP graphs), after refusing an fp8
        KV cache on GPUs that do not compute in float8_e4m3fn, the cache's format: without
        hardware for it the attention kernels convert in software, which RDNA3 and CDNA3 take
        minutes to compile (seen cross-compiling; never run). Needs no GPU."""
        if config.cache.cache_dtype == "fp8_e4m3":
            arch = cls.gfx_arch(0)
            if arch.fp8_dtype != torch.float8_e4m3fn:
                has = str(arch.fp8_dtype).removeprefix("torch.") if arch.fp8_dtype else "no fp8"
                raise ConfigError(
                    f"kv_cache_dtype fp8_e4m3 (a float8_e4m3fn cache) needs an AMD GPU that "
                    f"computes in float8_e4m3fn (CDNA4 gfx950, RDNA4 gfx12xx); this {arch.name} "
                    f"has {has}. Pass --kv-cache-dtype auto."
                )
        super().check_and_update_config(config)
