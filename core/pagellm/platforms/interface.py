"""The `Platform` interface: what the core asks of a kind of hardware."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from pagellm.config import EngineConfig
    from pagellm.distributed.parallel_state import CustomAllReduce, GroupCoordinator


class HostCopy:
    """Device tensors on their way to host memory (`Platform.copy_to_host`); `wait` returns
    them on the host once they are there. This base class copies at once (synchronously): right
    for platforms whose device is the host, where it copies nothing."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._host = [t.cpu() for t in tensors]

    def wait(self) -> list[torch.Tensor]:
        return self._host


class Platform:
    name: ClassVar[str]
    device_type: ClassVar[str]
    """torch device type: "cpu", "cuda", ..."""
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)
    needs_warm_up: ClassVar[bool] = False
    """True when kernels are compiled or tuned on first use (Triton, CUDA graphs): the engine
    core then runs short throwaway requests at start (`pagellm.engine.warm_up`), so that the
    first users do not wait for the compiler."""
    dist_backend: ClassVar[str] = "gloo"
    """The ``torch.distributed`` backend of tensor-parallel collectives between this platform's
    workers (`pagellm.distributed`)."""
    async_scheduling_default: ClassVar[bool] = False
    """What ``async_scheduling=None`` (the default) means here: whether the engine core plans the
    next step while the device runs the current one (`EngineCore`). Turned on for a platform only
    once it has been measured to win there."""

    @classmethod
    def device(cls, local_rank: int = 0) -> torch.device:
        return torch.device(cls.device_type)

    @classmethod
    def device_count(cls) -> int | None:
        """Devices this process may map ranks to (`device`); None: no limit (the CPU, where every
        rank shares the host)."""
        return None

    @classmethod
    def device_name(cls, device_id: int | None = None) -> str:
        """What the device is, for benchmark records (e.g. ``"NVIDIA H200"``); ``device_id`` is
        a logical id, None for the current device."""
        return cls.device_type

    @classmethod
    def default_dtype(cls, model_dtype: torch.dtype | None) -> torch.dtype:
        """The dtype used for ``dtype="auto"``, given the one the checkpoint declares."""
        if model_dtype in cls.supported_dtypes:
            return model_dtype
        return cls.supported_dtypes[0]

    @classmethod
    def fp8_dtype(cls) -> torch.dtype | None:
        """The float8 e4m3 format this platform's fp8 kernels compute in, None where it has none.
        float8_e4m3fn (the format checkpoints are written in) here and on NVIDIA GPUs; AMD CDNA3
        GPUs compute in float8_e4m3fnuz. Quantization plugins consult it before they run fp8."""
        return torch.float8_e4m3fn

    @classmethod
    def attention_backend_ranking(cls) -> list[str]:
        """Preferred attention backends, best first (only installed ones are considered)."""
        return []

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> None:
        """Last look at the finished config (e.g. pick defaults the hardware needs)."""

    @classmethod
    def available_kv_cache_memory(
        cls, config: EngineConfig, model_bytes: int, profile_run: Callable[[], None]
    ) -> int:
        """Bytes the KV cache may take on this device once the model is loaded.

        ``profile_run`` runs the model once on a batch of ``max_num_batched_tokens`` tokens (no KV
        cache yet), so a platform can measure the activations' peak memory."""
        raise NotImplementedError

    @classmethod
    def custom_ops(cls) -> dict[str, Callable[..., Any]]:
        """Fused kernels the model layers use instead of their plain torch code, by name
        (``"rms_norm"``, ``"rotary_embedding"``, ``"qk_norm_rotary"``, ...: `OP_NAMES` of
        `pagellm.layers.custom_ops`, whose docstring has their contracts). Layers look them up
        once, when they are built."""
        return {}

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        """Whether host staging buffers should be pinned (for non-blocking host→device copies)."""
        return False

    @classmethod
    def copy_to_host(cls, tensors: Sequence[torch.Tensor]) -> HostCopy:
        """Start copying a step's results (sampled ids, logprobs) to host memory without making
        the host wait for the device; the model runner reads them a step later, through
        `HostCopy.wait`. A device with its own streams copies on a side stream into pinned
        memory; the default copies synchronously."""
        return HostCopy(tensors)

    @classmethod
    def seed_everything(cls, seed: int) -> None:
        torch.manual_seed(seed)

    @classmethod
    def synchronize(cls) -> None:
        """Wait until the device has finished the work queued so far."""

    @classmethod
    def device_memory_used(cls) -> int | None:
        """Bytes in use on the current device, by any allocator or process (what start-up
        reports, e.g. the memory graph capture took, are measured with); None where unknown."""
        return None

    @classmethod
    def device_seconds(cls, work: Callable[[], object]) -> float:
        """Seconds the device takes to run what ``work`` queues (benchmarks time copies with it;
        a platform with device-side timers measures there, without the launch)."""
        start = time.perf_counter()
        work()
        cls.synchronize()
        return time.perf_counter() - start

    @classmethod
    def custom_all_reduce(cls, group: GroupCoordinator) -> CustomAllReduce | None:
        """A faster all-reduce for ``group`` than ``torch.distributed``'s, or None (the default:
        every platform of the project uses ``dist_backend``'s). Asked once per worker, after the
        process groups exist; the function it returns gets each all-reduce of the parallel
        layers and may decline a tensor by returning None (e.g. one-shot reductions over peer
        memory for small decode activations, NCCL beyond a size). On a platform that captures
        graphs, it must be capturable like the collectives it replaces."""
        return None

    @classmethod
    def graph_pool(cls) -> object:
        """A memory pool for the graphs one model runner captures (`capture_graph`): they share
        it, as only one of them runs at a time. None where graphs need none."""
        return None

    @classmethod
    def capture_graph(
        cls, forward: Callable[[], torch.Tensor], pool: object
    ) -> tuple[Callable[[], None], torch.Tensor]:
        """Record one call of ``forward`` as a device graph in ``pool``; return its replay, which
        re-runs the recorded kernels on whatever their input buffers then hold, and the output
        tensor every replay writes. Asked only when ``compilation.cudagraph_mode`` is not
        ``"none"``: for whole decode steps (`pagellm.worker.cudagraphs`) and for the pieces of
        a forward pass between attention calls (`pagellm.worker.piecewise`)."""
        raise NotImplementedError(
            f"Platform {cls.name} cannot capture graphs: its check_and_update_config must leave "
            "compilation.cudagraph_mode at 'none'."
        )
