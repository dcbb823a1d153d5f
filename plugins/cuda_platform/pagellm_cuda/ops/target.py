"""The GPU target a kernel is launched for, and its warp size, which sizes the launches.

NVIDIA warps are 32 threads; AMD wavefronts are 64 on CDNA and 32 on RDNA (the ROCm platform runs
these kernels too). A launch asks the tensors' device, once per device; cross-compiling for a GPU
that is not here passes the target explicitly (pagellm-rocm's tests compile for AMD targets).
"""

from __future__ import annotations

import functools

import torch
from triton.backends.compiler import GPUTarget


@functools.cache
def _device_target(index: int) -> GPUTarget:
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip is not None:
        return GPUTarget("hip", props.gcnArchName.split(":")[0], props.warp_size)
    return GPUTarget("cuda", props.major * 10 + props.minor, 32)


try:  # Triton 3.3 and later
    from triton.language.extra.cuda import gdc_launch_dependents
except ImportError:  # pragma: no cover - Triton 3.2
    gdc_launch_dependents = None


def launches_dependents(device: torch.device, target: GPUTarget | None = None) -> bool:
    """Whether a kernel for ``target`` (else ``device``'s GPU) should let the kernel after it
    start early (``griddepcontrol.launch_dependents``): NVIDIA sm_90 and later, compiled (not
    Triton's interpreter), with a Triton that has it. The instruction only matters to a next
    kernel launched with programmatic dependent launch (pagellm-int4's GEMM with
    ``PAGELLM_INT4_PDL=1``), which waits for this one's completion before it reads its output;
    for any other next kernel it does nothing."""
    if target is None:
        if device.type != "cuda":
            return False
        index = torch.cuda.current_device() if device.index is None else device.index
        return _device_launches_dependents(index)
    return _target_launches_dependents(target)


def _target_launches_dependents(target: GPUTarget) -> bool:
    return gdc_launch_dependents is not None and target.backend == "cuda" and target.arch >= 90


@functools.cache
def _device_launches_dependents(index: int) -> bool:
    """Once a device (a norm or SiLU launch asks at every call)."""
    return _target_launches_dependents(_device_target(index))


def warp_size(device: torch.device, target: GPUTarget | None = None) -> int:
    """Threads per warp (wavefront) on ``target``, else on ``device``; 32 off the GPU (Triton's
    interpreter, which runs the NVIDIA launch shapes)."""
    if target is not None:
        return int(target.warp_size)
    if device.type != "cuda":
        return 32
    index = torch.cuda.current_device() if device.index is None else device.index
    return int(_device_target(index).warp_size)
