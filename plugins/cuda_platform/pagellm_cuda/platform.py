"""`CudaPlatform`: pagellm on NVIDIA GPUs through PyTorch's CUDA build.

Methods that call into ``torch.cuda`` (device facts, `CudaPlatform.device`, profiling,
synchronisation, timing, graph capture) run only on a GPU. The rules they apply are plain functions tested everywhere:
`auto_dtype`, `pagellm_cuda.devices`, `pagellm_cuda.memory`, `pagellm_cuda.cudagraphs`, and
`CudaPlatform.check_and_update_config`, which needs no GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from pagellm.attention.registry import attention_backends
from pagellm.platforms.interface import HostCopy, Platform
from pagellm_cuda.cudagraphs import cudagraph_capture_sizes
from pagellm_cuda.devices import cuda_device_count, physical_device_id, visible_device_id
from pagellm_cuda.host_copy import CudaHostCopy
from pagellm_cuda.memory import (
    cudagraph_reserve,
    kv_cache_bytes,
    piecewise_reserve,
    profile_memory,
)

if TYPE_CHECKING:
    from pagellm.config import EngineConfig

logger = logging.getLogger(__name__)

DISABLE_CUSTOM_OPS_VAR = "PAGELLM_DISABLE_CUSTOM_OPS"
BF16_MIN_CAPABILITY = (8, 0)
"""Ampere: the first GPUs with bfloat16 tensor cores."""


def auto_dtype(model_dtype: torch.dtype | None, capability: tuple[int, int]) -> torch.dtype:
    """The dtype for ``dtype="auto"`` on a GPU of compute ``capability``.

    As vLLM does: a float16 checkpoint stays float16 (its values fit float16's range, and
    bfloat16 would drop three bits of their mantissa); everything else
    (bfloat16, float32, undeclared) runs in bfloat16 where the GPU has it (>= 8.0), else in
    float16. float32 checkpoints are not run in float32 by default: half the memory and several
    times the matmul throughput, for a precision loss the models tolerate. An explicit
    ``dtype="float32"`` is still honoured (the core checks it against `supported_dtypes`).
    """
    if model_dtype == torch.float16:
        return torch.float16
    return torch.bfloat16 if capability >= BF16_MIN_CAPABILITY else torch.float16


@functools.cache
def _load_custom_ops() -> dict[str, Callable[..., Any]]:
    # Imported lazily: the kernels need Triton, which a working CUDA platform does not.
    try:
        from pagellm_cuda.ops import CUSTOM_OPS
    except ImportError as exc:
        logger.warning("CUDA custom ops unavailable (%s); layers use their torch code.", exc)
        return {}
    return dict(CUSTOM_OPS)


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    supported_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    needs_warm_up = True  # Triton compiles its kernels on first use; graphs are replayed
    # Measured on an H200 (docs/benchmarks.md, 2026-12-02): W2 +31 %, W1 +7 %, the prefill-heavy
    # run 11 % faster, the same tokens; `--no-async-scheduling` turns it off.
    async_scheduling_default = True
    dist_backend = "nccl"

    # ------------------------------------------------------------------ devices (GPU only)

    @classmethod
    def device(cls, local_rank: int = 0) -> torch.device:
        """The worker's device, made this process's current CUDA device: a worker owns one GPU,
        and what follows (allocations without a device, memory profiling, NCCL, graph capture)
        works on the current device."""
        index = visible_device_id(local_rank, os.environ, cuda_device_count())
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    @classmethod
    def device_count(cls) -> int | None:
        """The visible GPUs (``CUDA_VISIBLE_DEVICES`` applied)."""
        return cuda_device_count()

    @classmethod
    def _index(cls, device_id: int | None) -> int:
        if device_id is None:
            return torch.cuda.current_device()
        return visible_device_id(device_id, os.environ, cuda_device_count())

    @classmethod
    def device_name(cls, device_id: int | None = None) -> str:
        """e.g. ``"NVIDIA H200"``; ``device_id`` is a logical id, None for the current device."""
        return torch.cuda.get_device_name(cls._index(device_id))

    @classmethod
    def device_capability(cls, device_id: int | None = None) -> tuple[int, int]:
        """Compute capability (major, minor), e.g. (9, 0) for Hopper."""
        major, minor = torch.cuda.get_device_capability(cls._index(device_id))
        return major, minor

    @classmethod
    def total_memory(cls, device_id: int | None = None) -> int:
        """Bytes of device memory."""
        return torch.cuda.get_device_properties(cls._index(device_id)).total_memory

    @classmethod
    def physical_device_id(cls, local_rank: int) -> int | str:
        """The id ``nvidia-smi`` / NVML know the worker's GPU by (index, or UUID when
        ``CUDA_VISIBLE_DEVICES`` names UUIDs)."""
        return physical_device_id(local_rank, os.environ, cuda_device_count())

    # ------------------------------------------------------------------ configuration

    @classmethod
    def default_dtype(cls, model_dtype: torch.dtype | None) -> torch.dtype:
        """See `auto_dtype`; asks the current GPU for its capability (initialises CUDA)."""
        return auto_dtype(model_dtype, cls.device_capability())

    @classmethod
    def attention_backend_ranking(cls) -> list[str]:
        return ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "TORCH_SDPA"]

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> None:
        """Turn on CUDA graphs for decode-only batches, unless the user forced eager mode or the
        chosen attention backend cannot be captured. Needs no GPU."""
        comp = config.compilation
        backend = config.attention_backend
        why_not = None
        if comp.enforce_eager:
            why_not = "--enforce-eager"
        elif not attention_backends.get(backend).cudagraph_support:
            why_not = f"attention backend {backend} does not support them"
        if why_not is not None:
            comp.cudagraph_mode = "none"
            comp.cudagraph_capture_sizes = []
            logger.info("CUDA graphs off (%s): every step runs eagerly.", why_not)
            return
        comp.cudagraph_mode = "decode"
        comp.cudagraph_capture_sizes = cudagraph_capture_sizes(config.scheduler.max_num_seqs)
        sizes = comp.cudagraph_capture_sizes
        logger.info(
            "CUDA graphs on for decode batches of %d..%d requests (%d sizes).",
            sizes[0],
            sizes[-1],
            len(sizes),
        )

    # ------------------------------------------------------------------ memory

    @classmethod
    def available_kv_cache_memory(
        cls, config: EngineConfig, model_bytes: int, profile_run: Callable[[], None]
    ) -> int:
        """``kv_cache_memory`` when the user set it; otherwise measured on the GPU (GPU only).

        ``gpu_memory_utilization × total`` minus the peak memory of a profiling run over
        ``max_num_batched_tokens`` tokens (weights, activations, memory outside PyTorch) and,
        when CUDA graphs are on, an estimate of their memory (`cudagraph_reserve`, and
        `piecewise_reserve` with piecewise graphs). Memory that
        other processes hold on the same GPU counts against the budget too.
        """
        cache = config.cache
        if cache.kv_cache_memory is not None:
            logger.info(
                "KV cache memory: %.2f GiB, as set (kv_cache_memory).",
                cache.kv_cache_memory / 2**30,
            )
            return cache.kv_cache_memory
        profile = profile_memory(model_bytes, profile_run)
        comp, budget = config.compilation, config.scheduler.max_num_batched_tokens
        if comp.cudagraph_mode != "none":
            decode, piecewise = comp.cudagraph_capture_sizes, comp.piecewise_capture_sizes
            reserve = cudagraph_reserve(
                profile.activations, decode[-1] if decode else 0, budget, len(decode)
            ) + piecewise_reserve(
                profile.activations,
                piecewise[-1] if piecewise else 0,
                budget,
                len(piecewise) * (config.model.num_layers + 1),  # one graph per segment
            )
            profile = dataclasses.replace(profile, cudagraphs=reserve)
        available = kv_cache_bytes(profile, cache.gpu_memory_utilization)
        gib = 2**30
        logger.info(
            "GPU memory: %.2f GiB total x gpu_memory_utilization %g = %.2f GiB; weights %.2f GiB, "
            "other tensors %.2f GiB, peak activations %.2f GiB, outside PyTorch %.2f GiB, "
            "CUDA graphs (estimate) %.2f GiB; KV cache %.2f GiB.",
            profile.total / gib,
            cache.gpu_memory_utilization,
            cache.gpu_memory_utilization * profile.total / gib,
            profile.weights / gib,
            profile.other_tensors / gib,
            profile.activations / gib,
            profile.non_torch / gib,
            profile.cudagraphs / gib,
            available / gib,
        )
        return available

    # ------------------------------------------------------------------ kernels and runtime

    @classmethod
    def custom_ops(cls) -> dict[str, Callable[..., Any]]:
        """The Triton kernels of `pagellm_cuda.ops`, unless ``PAGELLM_DISABLE_CUSTOM_OPS=1``
        (for A/B comparisons) or they cannot be imported (warned once)."""
        if os.environ.get(DISABLE_CUSTOM_OPS_VAR, "").lower() in ("1", "true", "yes"):
            return {}
        return dict(_load_custom_ops())

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return True

    @classmethod
    def copy_to_host(cls, tensors: Sequence[torch.Tensor]) -> HostCopy:
        """On a side stream into pinned memory, with an event (`pagellm_cuda.host_copy`)."""
        return CudaHostCopy(tensors)

    @classmethod
    def seed_everything(cls, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)  # deferred until CUDA initialises

    @classmethod
    def synchronize(cls) -> None:
        torch.cuda.synchronize()

    @classmethod
    def device_memory_used(cls) -> int | None:
        """What the driver reports used on the current GPU (every process's, and memory outside
        torch's allocator, such as graphs' executables)."""
        free, total = torch.cuda.mem_get_info()
        return total - free

    @classmethod
    def device_seconds(cls, work: Callable[[], object]) -> float:
        """Timed by CUDA events around the work: the device's time, not the host's."""
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        work()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3

    # ------------------------------------------------------------------ CUDA graphs

    @classmethod
    def graph_pool(cls) -> object:
        return torch.cuda.graph_pool_handle()

    @classmethod
    def capture_graph(
        cls, forward: Callable[[], torch.Tensor], pool: object
    ) -> tuple[Callable[[], None], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=cast(Any, pool)):  # the handle of graph_pool
            output = forward()
        return graph.replay, output
