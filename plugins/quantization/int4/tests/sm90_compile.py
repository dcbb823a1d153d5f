"""Compile pagellm-int4's fused W4A16 kernel for an H100/H200 (sm_90) on a machine without a GPU,
for every kind of program (``dot``, ``dot_t``, two MMA chains, ``fma``; with the inline PTX
unpack, and with Triton ops): Triton lowers it and its bundled ptxas assembles it, which catches
what the interpreter cannot run (the inline PTX) or check (layouts, types that do not lower).
Run as a script, outside interpreter mode, by test_int4_kernels.py; prints one line per variant
with the size of its cubin."""

from __future__ import annotations

import triton
from pagellm_int4.kernels.unpack import CODE_OFFSET
from pagellm_int4.kernels.w4a16 import _w4a16_gemm_kernel
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
SIGNATURE = {
    "x_ptr": "*bf16",
    "qw_ptr": "*i32",
    "s_ptr": "*fp32",
    "z_ptr": "*u8",
    "out_ptr": "*bf16",
    "ws_ptr": "*fp32",
    "cnt_ptr": "*i32",
    "M": "i32",
    "N": "i32",
    "K": "i32",
    "stride_xm": "i32",
    "stride_qk": "i32",
    "stride_om": "i32",
    "stride_os": "i32",
    "split_k": "i32",
}
# (name, kind constexprs, block_m, block_n, num_warps)
VARIANTS = [
    ("dot asm", dict(USE_DOT=True, USE_ASM=True, SWAP=False, CHAINS=1), 16, 64, 4),
    ("dot asm chains=2", dict(USE_DOT=True, USE_ASM=True, SWAP=False, CHAINS=2), 16, 64, 4),
    ("dot_t asm", dict(USE_DOT=True, USE_ASM=True, SWAP=True, CHAINS=1), 16, 128, 4),
    ("dot shift", dict(USE_DOT=True, USE_ASM=False, SWAP=False, CHAINS=1), 16, 64, 4),
    ("fma asm", dict(USE_DOT=False, USE_ASM=True, SWAP=False, CHAINS=1), 1, 64, 4),
    ("fma asm, 4 rows", dict(USE_DOT=False, USE_ASM=True, SWAP=False, CHAINS=1), 4, 128, 4),
    ("fma shift", dict(USE_DOT=False, USE_ASM=False, SWAP=False, CHAINS=1), 1, 64, 4),
]


# What Triton's launcher marks at a Llama-8B shape: every pointer (the tile counters aside) and
# each integer that is a multiple of 16 there (N, K and the strides).
ALIGNED = [n for n in SIGNATURE if n.endswith("_ptr") and n != "cnt_ptr"]
ALIGNED += ["N", "K", "stride_xm", "stride_qk", "stride_om", "stride_os"]


def compile_variant(kind: dict, block_m: int, block_n: int, warps: int):
    """The fused kernel for sm_90 with bf16 activations, group 128 and the split-K serial sum,
    as one kind of program (``kind``: USE_DOT, USE_ASM, SWAP, CHAINS): Triton's compiled kernel
    (``.asm["cubin"]``, ``.asm["ptx"]``)."""
    code = 1  # bfloat16 activations
    constexprs = {
        "TILES": 8,
        "SPLIT": True,
        "SERIAL": True,
        "GROUP_SIZE": 128,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": 128,
        "SCALES_PER_TILE": True,
        **kind,
        "CODE": code,
        "OFFSET": CODE_OFFSET[code],
        "EVEN_K": True,
        "EVEN_N": True,
    }
    signature = {**SIGNATURE, **dict.fromkeys(constexprs, "constexpr")}
    attrs = {(list(signature).index(n),): [["tt.divisibility", 16]] for n in ALIGNED}
    return triton.compile(
        ASTSource(_w4a16_gemm_kernel, signature, constexprs, attrs),
        target=TARGET,
        options={"num_warps": warps, "num_stages": 3},
    )


def main() -> None:
    for name, kind, block_m, block_n, warps in VARIANTS:
        compiled = compile_variant(kind, block_m, block_n, warps)
        print(f"compiled {name}: {len(compiled.asm['cubin'])} bytes of cubin", flush=True)


if __name__ == "__main__":
    main()
