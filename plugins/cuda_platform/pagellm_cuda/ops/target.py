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


def warp_size(device: torch.device, target: GPUTarget | None = None) -> int:
    """Threads per warp (wavefront) on ``target``, else on ``device``; 32 off the GPU (Triton's
    interpreter, which runs the NVIDIA launch shapes)."""
    if target is not None:
        return int(target.warp_size)
    if device.type != "cuda":
        return 32
    index = torch.cuda.current_device() if device.index is None else device.index
    return int(_device_target(index).warp_size)
