"""How much GPU memory the KV cache may take, measured by running the model once.

The arithmetic (`MemoryProfile`, `kv_cache_bytes`, `cudagraph_reserve`, `piecewise_reserve`) is
pure and tested on any machine; only `profile_memory` touches the GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

CUDAGRAPH_OVERHEAD_PER_GRAPH = 2 << 20
"""Device memory one captured decode graph holds outside torch's allocator (its executable
graph), a generous round figure for Llama-sized models."""


PIECEWISE_OVERHEAD_PER_GRAPH = 256 << 10
"""The same for one piecewise graph (one layer's kernels between two attention calls), a
generous round figure until measured."""


class InsufficientMemoryError(ValueError):
    """The model alone already takes the memory the KV cache was meant to have."""


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True)
class MemoryProfile:
    """One device's memory around a profiling run, in bytes."""

    total: int
    """The device's memory."""
    weights: int
    """The model's parameters (part of ``baseline``)."""
    baseline: int
    """torch-allocated before the run: weights, buffers, the runner's persistent inputs."""
    peak: int
    """torch's peak allocation during the run (``baseline`` plus the activations)."""
    non_torch: int
    """Used on the device outside torch's allocator: the CUDA context, library workspaces, NCCL,
    and other processes on the same GPU."""
    cudagraphs: int = 0
    """Set aside for the CUDA graphs captured after the KV cache (`cudagraph_reserve`)."""

    @property
    def other_tensors(self) -> int:
        return max(0, self.baseline - self.weights)

    @property
    def activations(self) -> int:
        return max(0, self.peak - self.baseline)

    @property
    def peak_used(self) -> int:
        """Everything but the KV cache, at its worst."""
        return self.peak + self.non_torch + self.cudagraphs


def kv_cache_bytes(profile: MemoryProfile, utilization: float) -> int:
    """``utilization × total − peak_used``: the KV cache gets what is left of the share of the
    device pagellm may use once the model runs at its peak. Raises `InsufficientMemoryError` with
    the numbers when nothing is left."""
    budget = int(utilization * profile.total)
    available = budget - profile.peak_used
    if available > 0:
        return available
    graphs = f", {_gib(profile.cudagraphs)} set aside for CUDA graphs" if profile.cudagraphs else ""
    eager = " or pass --enforce-eager (no CUDA graphs)" if profile.cudagraphs else ""
    raise InsufficientMemoryError(
        f"No GPU memory is left for the KV cache: gpu_memory_utilization {utilization:g} of "
        f"{_gib(profile.total)} allows {_gib(budget)}, but running the model already takes "
        f"{_gib(profile.peak_used)} (weights {_gib(profile.weights)}, other tensors "
        f"{_gib(profile.other_tensors)}, peak activations "
        f"{_gib(profile.activations)}, {_gib(profile.non_torch)} outside PyTorch (CUDA context, "
        f"libraries, other processes){graphs}). Raise --gpu-memory-utilization, lower "
        f"--max-num-batched-tokens (the activation peak grows with it) or --max-model-len"
        f"{eager}, or serve a smaller or quantized model."
    )


def cudagraph_reserve(
    activations: int, max_capture_size: int, max_num_batched_tokens: int, num_graphs: int
) -> int:
    """Estimated memory of the decode graphs captured after the KV cache is allocated.

    The graphs share one private memory pool sized by the largest one, whose forward pass holds
    ``max_capture_size`` tokens where the profiling run held ``max_num_batched_tokens``;
    activations scale about linearly with tokens. Each graph also holds
    `CUDAGRAPH_OVERHEAD_PER_GRAPH` outside torch. An estimate: the ``1 − gpu_memory_utilization``
    headroom absorbs the error.
    """
    if num_graphs == 0:
        return 0
    share = min(1.0, max_capture_size / max_num_batched_tokens)
    return int(activations * share) + num_graphs * CUDAGRAPH_OVERHEAD_PER_GRAPH


def piecewise_reserve(
    activations: int, max_capture_size: int, max_num_batched_tokens: int, num_graphs: int
) -> int:
    """Estimated memory of the piecewise graphs (`pagellm.worker.piecewise`) beyond what
    `cudagraph_reserve` sets aside for the decode graphs.

    Their segments' temporaries share the decode graphs' pool and, at ``max_capture_size``
    tokens, take at most one layer's activations at that many tokens: at most the profiling
    run's activations (``max_num_batched_tokens`` tokens) scaled down, as for the decode graphs.
    The buffers between segments (q, k, v, the residual and the attention output at the largest
    size) take about as much again, and each graph `PIECEWISE_OVERHEAD_PER_GRAPH` outside
    torch."""
    if num_graphs == 0:
        return 0
    share = min(1.0, max_capture_size / max_num_batched_tokens)
    return 2 * int(activations * share) + num_graphs * PIECEWISE_OVERHEAD_PER_GRAPH


def profile_memory(weights: int, profile_run: Callable[[], None]) -> MemoryProfile:
    """Run ``profile_run`` on the current CUDA device and measure the memory it peaks at.

    GPU only. torch's allocator reports its own peak exactly; memory outside it is what the driver
    reports used minus what torch has reserved, read after the run (cuBLAS and friends create
    their workspaces on first use).
    """
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    _, total = torch.cuda.mem_get_info()
    baseline = torch.cuda.memory_allocated()
    profile_run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    free, _ = torch.cuda.mem_get_info()
    non_torch = max(0, total - free - torch.cuda.memory_reserved())
    # Give the activations' cached blocks back so the KV cache can be allocated in their place.
    torch.cuda.empty_cache()
    return MemoryProfile(
        total=total, weights=weights, baseline=baseline, peak=peak, non_torch=non_torch
    )
