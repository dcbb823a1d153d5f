"""pagellm-int4's Triton kernels (``w4a16``): the fused W4A16 GEMM of decode-sized batches and
the dequantization of a whole weight for the cuBLAS path (``dequantize``), both reading the kernel
layout of ``pagellm_int4.kernel_layout``."""

import os

# Triton reads the same variable when it decorates the kernels.
if os.environ.get("TRITON_INTERPRET") == "1":
    from .interpreter import allow_runtime_loop_bounds

    allow_runtime_loop_bounds()
