"""The kernels FLASH_ATTN can run, one module each.

- `fa4` (flash-attn-4, CuTe DSL), `fa3` (vLLM's FA3), `fa2` (flash-attn 2.x): FlashAttention
  providers, which serve prefill, mixed and decode steps;
- `triton_decode` (pagellm-triton-attn's decode kernel): decode rows only.

`base` holds what they share; `fa4_setup` and `jit_log` serve FA4's import and its JIT compiles.
"""

from __future__ import annotations

from .base import AttentionKernel, KernelUnavailable, LayerParams, gpu_capability
from .fa2 import FA2Kernel
from .fa3 import FA3Kernel
from .fa4 import FA4Kernel
from .triton_decode import TritonDecodeKernel

PROVIDERS: tuple[type[AttentionKernel], ...] = (FA4Kernel, FA3Kernel, FA2Kernel)
"""The FlashAttention builds, in the order preferred where no measurement decides."""
_ALL: tuple[type[AttentionKernel], ...] = (*PROVIDERS, TritonDecodeKernel)
KERNELS: dict[str, type[AttentionKernel]] = {k.name: k for k in _ALL}

__all__ = [
    "KERNELS",
    "PROVIDERS",
    "AttentionKernel",
    "FA2Kernel",
    "FA3Kernel",
    "FA4Kernel",
    "KernelUnavailable",
    "LayerParams",
    "TritonDecodeKernel",
    "gpu_capability",
]
