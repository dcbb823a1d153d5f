"""Compile the RMSNorm and SiLU-and-mul kernels for an H100/H200 (sm_90) and an A100 (sm_80) on a
machine without a GPU, with the launch-dependents flag each target gets
(`pagellm_cuda.ops.target.launches_dependents`), and print whether each PTX holds
``griddepcontrol.launch_dependents``. Run as a script, outside interpreter mode, by
test_cuda_ops.py."""

from __future__ import annotations

import torch
import triton
from pagellm_cuda.ops.activation import _silu_and_mul_kernel
from pagellm_cuda.ops.layernorm import _rms_norm_kernel
from pagellm_cuda.ops.target import launches_dependents
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

NORM = {
    "x_ptr": "*bf16",
    "x_row_stride": "i32",
    "x_head_stride": "i32",
    "heads": "i32",
    "residual_ptr": "*bf16",
    "residual_row_stride": "i32",
    "out_ptr": "*bf16",
    "out_row_stride": "i32",
    "weight_ptr": "*bf16",
    "n_rows": "i32",
    "n_cols": "i32",
    "eps": "fp32",
}
SILU = {
    "x_ptr": "*bf16",
    "x_row_stride": "i32",
    "out_ptr": "*bf16",
    "out_row_stride": "i32",
    "d": "i32",
}


def compile_kernel(fn, signature: dict, constexprs: dict, target: GPUTarget) -> str:
    flagged = {**constexprs, "LAUNCH_DEPENDENTS": launches_dependents(torch.device("cpu"), target)}
    full = {**signature, **dict.fromkeys(flagged, "constexpr")}
    compiled = triton.compile(ASTSource(fn, full, flagged), target=target, options={"num_warps": 4})
    return compiled.asm["ptx"]


def main() -> None:
    for arch in (90, 80):
        target = GPUTarget("cuda", arch, 32)
        for name, fn, signature, constexprs in (
            ("rms_norm", _rms_norm_kernel, NORM, {"HAS_RESIDUAL": True, "ROWS": 1, "BLOCK": 4096}),
            ("silu_and_mul", _silu_and_mul_kernel, SILU, {"BLOCK": 1024}),
        ):
            ptx = compile_kernel(fn, signature, constexprs, target)
            print(f"sm_{arch} {name} launch_dependents={'griddepcontrol.launch_dependents' in ptx}")


if __name__ == "__main__":
    main()
