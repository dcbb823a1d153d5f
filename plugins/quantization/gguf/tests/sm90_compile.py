"""Compile pagellm-gguf's plane kernels for an H100/H200 (sm_90) on a machine without a GPU:
Triton lowers them and its bundled ptxas assembles them, which catches what the interpreter
cannot (layouts, constexpr misuse, types that do not lower). Run as a script, outside
interpreter mode, by test_gguf_kernels.py; prints one line per kernel compiled."""

from __future__ import annotations

import torch
import triton
from pagellm_gguf.kernels import plane_dequantize_kernel, plane_matmul_kernel
from pagellm_gguf.planes import LAYOUTS
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
ALIGNED = ("x_ptr", "codes_ptr", "high_ptr", "scale_ptr", "bias_ptr", "y_ptr", "out_ptr")
ALIGNED_INTS = ("N", "stride_xm", "stride_ym", "stride_ys")  # as a launch with N = 4096 marks


def _compile(kernel, signature: dict[str, str], constexprs: dict[str, object], **options) -> None:
    names = list(signature)
    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    attrs = {
        (list(signature).index(n),): [["tt.divisibility", 16]]
        for n in names
        if n in ALIGNED or n in ALIGNED_INTS
    }
    triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET, options=options)


def main() -> None:
    for index, (qtype, layout) in enumerate(LAYOUTS.items()):
        scale = "*fp16" if layout.scale_dtype == torch.float16 else "*fp32"
        consts = {
            "CODE_BITS": layout.code_bits,
            "SIGNED": layout.signed,
            "HIGH_BITS": layout.high_bits,
            "GROUP": layout.group,
            "OFFSET": layout.offset,
            "HAS_BIAS": layout.has_bias,
        }
        planes = {"codes_ptr": "*i32", "high_ptr": "*i32", "scale_ptr": scale, "bias_ptr": scale}
        dot = index % 2 == 0  # each type one way, both ways over the types
        x_dtype = "*bf16" if dot else "*fp32"
        _compile(
            plane_matmul_kernel,
            {"x_ptr": x_dtype, **planes, "y_ptr": "*fp32", "M": "i32", "N": "i32",
             "stride_xm": "i32", "stride_ym": "i32", "stride_ys": "i32"},
            {"K": 4096, "K_SPLIT": 1024, **consts, "IEEE": not dot, "USE_DOT": dot,
             "BLOCK_M": 16 if dot else 1, "BLOCK_N": 64, "BLOCK_K": 32 * layout.per_word},
            num_warps=4,
            num_stages=3,
        )  # fmt: skip
        _compile(
            plane_dequantize_kernel,
            {**planes, "out_ptr": "*bf16", "N": "i32", "K": "i32"},
            {**consts, "BLOCK_N": 128, "BLOCK_K": 32 * layout.per_word},
            num_warps=4,
        )
        print(f"compiled {qtype} dot={dot}", flush=True)


if __name__ == "__main__":
    main()
