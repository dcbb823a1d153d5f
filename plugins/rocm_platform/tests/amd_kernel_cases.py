"""Every Triton kernel the ROCm platform runs, launched by its own host function for each AMD
target and compiled for it (`pagellm_rocm.cross_compile`); prints one JSON object.

    python plugins/rocm_platform/tests/amd_kernel_cases.py [gfx942 gfx950 gfx1100]

Runs in a process where Triton compiles (``TRITON_INTERPRET`` unset or 0); test_amd_kernels.py
starts it. The kernels are TRITON_ATTN's (`pagellm_triton_attn.kernels`) and the fused ops of
`pagellm_cuda.ops` that the ROCm platform's ``custom_ops()`` returns, and pagellm-fp8's
activation quantization and block-scaled GEMM in the fp8 format of the target
(`pagellm_fp8.kernels`: float8_e4m3fnuz on gfx942, float8_e4m3fn on gfx950). The tensors are CPU
tensors of a Llama-like layer (8 KV heads, GQA 4, head size 128, a 4096-wide hidden state): the
host functions read only their shapes, strides, dtypes and alignment.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from types import ModuleType

import torch
from pagellm_rocm.cross_compile import (
    AMD_TARGETS,
    CrossCompileError,
    compile_launch,
    recorded_launches,
)

BF16, FP8, FNUZ = torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz
KV_HEADS, GQA, HEAD, PAGE, BLOCKS = 8, 4, 128, 16, 32
HIDDEN = 4096

Case = Callable[..., None]


def attention_tensors(dtype: torch.dtype, cache_dtype: torch.dtype, head: int = HEAD) -> dict:
    """Two requests: a 24-token prompt chunk after 40 cached tokens, and one decode row."""
    tokens = 25
    return dict(
        query=torch.empty(tokens, KV_HEADS * GQA, head, dtype=dtype),
        key_cache=torch.empty(BLOCKS, KV_HEADS, PAGE, head, dtype=cache_dtype),
        value_cache=torch.empty(BLOCKS, KV_HEADS, PAGE, head, dtype=cache_dtype),
        out=torch.empty(tokens, KV_HEADS * GQA, head, dtype=dtype),
        query_start_loc=torch.tensor([0, 24, 25], dtype=torch.int32),
        seq_lens=torch.tensor([64, 90], dtype=torch.int32),
        block_table=torch.zeros(2, 8, dtype=torch.int32),
    )


def kv_write(dtype: torch.dtype, cache_dtype: torch.dtype) -> Case:
    def run(kernels: ModuleType, target) -> None:
        t = attention_tensors(dtype, cache_dtype)
        new = torch.empty(25, KV_HEADS, HEAD, dtype=dtype)
        slots = torch.zeros(25, dtype=torch.int64)
        kernels.write_kv_cache(
            new, new, t["key_cache"], t["value_cache"], slots, 0.5, 0.5, target=target
        )

    return run


def mixed(dtype: torch.dtype, cache_dtype: torch.dtype) -> Case:
    def run(kernels: ModuleType, target) -> None:
        kernels.paged_attention(
            **attention_tensors(dtype, cache_dtype), num_reqs=2, num_tokens=25,
            max_query_len=24, scale=HEAD**-0.5, sliding_window=None, skip_decodes=True,
            target=target,
        )  # fmt: skip

    return run


def decode(dtype: torch.dtype, cache_dtype: torch.dtype, head: int = HEAD) -> Case:
    """Split-KV decode over two splits: the split kernel and the merge kernel."""

    def run(kernels: ModuleType, target) -> None:
        t = attention_tensors(dtype, cache_dtype, head)
        scratch = kernels.split_scratch(2, KV_HEADS * GQA, head, 2, torch.device("cpu"))
        kernels.paged_decode(
            **t, num_rows=2, scale=head**-0.5, sliding_window=None, num_splits=2,
            scratch=scratch, target=target,
        )  # fmt: skip

    return run


def op(name: str) -> Case:
    def run(ops: ModuleType, target) -> None:
        x = torch.empty(16, HIDDEN, dtype=BF16)
        weight = torch.empty(HIDDEN, dtype=BF16)
        if name == "rms_norm":
            ops.rms_norm(x, weight, 1e-6, target=target)
        elif name == "fused_add_rms_norm":
            ops.fused_add_rms_norm(x, torch.empty_like(x), weight, 1e-6, target=target)
        elif name == "per_head_rms_norm":  # q/k norms of Qwen3, read in place from a fused qkv
            qkv = torch.empty(16, (KV_HEADS * GQA + 2 * KV_HEADS) * HEAD, dtype=BF16)
            q = qkv[:, : KV_HEADS * GQA * HEAD].view(16, KV_HEADS * GQA, HEAD)
            ops.rms_norm(q, torch.empty(HEAD, dtype=BF16), 1e-6, target=target)
        elif name == "rotary_embedding":
            q = torch.empty(16, KV_HEADS * GQA * HEAD, dtype=BF16)
            k = torch.empty(16, KV_HEADS * HEAD, dtype=BF16)
            cache = torch.empty(4096, HEAD, dtype=torch.float32)
            positions = torch.zeros(16, dtype=torch.int64)
            ops.rotary_embedding(positions, q, k, HEAD, cache, target=target)
        elif name == "qk_norm_rotary":  # Qwen3's q/k norms and rotary, in place in a fused qkv
            qkv = torch.empty(16, (KV_HEADS * GQA + 2 * KV_HEADS) * HEAD, dtype=BF16)
            q, k, _ = qkv.split([KV_HEADS * GQA * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD], -1)
            weight = torch.empty(HEAD, dtype=BF16)
            cache = torch.empty(4096, HEAD, dtype=torch.float32)
            positions = torch.zeros(16, dtype=torch.int64)
            ops.qk_norm_rotary(positions, q, k, weight, weight, 1e-6, HEAD, cache, target=target)
        elif name == "silu_and_mul":
            ops.silu_and_mul(torch.empty(16, 2 * 14336, dtype=BF16), target=target)
        elif name == "write_paged_kv":
            new = torch.empty(16, KV_HEADS, HEAD, dtype=BF16)
            cache = torch.empty(BLOCKS, PAGE, KV_HEADS, HEAD, dtype=BF16)
            slots = torch.zeros(16, dtype=torch.int64)
            ops.write_paged_kv(new, new, cache, cache, slots, target=target)

    return run


def fp8(name: str, fp8_dtype: torch.dtype) -> Case:
    """pagellm-fp8's kernels on a 16-token batch of a 4096-wide layer, in ``fp8_dtype``."""

    def run(kernels: ModuleType, target) -> None:
        import importlib

        quant = importlib.import_module(f"{FP8_KERNELS}.quant")
        x = torch.empty(16, HIDDEN, dtype=BF16)
        if name == "per_token_quant":
            quant.per_token_quant_fp8(x, dtype=fp8_dtype)
        elif name == "per_tensor_quant":  # dynamic: the amax pass, then the quantization
            quant.per_tensor_quant_fp8(x, dtype=fp8_dtype)  # one maximum per row
            # Past ROW_MAXIMA_MAX_M rows: an atomic maximum per chunk.
            many = torch.empty(quant.ROW_MAXIMA_MAX_M + 1, HIDDEN, dtype=BF16)
            quant.per_tensor_quant_fp8(many, dtype=fp8_dtype)
            # One launch: the rows' maxima, a grid barrier (acquire-release atomics), the rows.
            quant.per_tensor_quant_fp8(x, dtype=fp8_dtype, one_launch=True)
        elif name == "per_token_group_quant":
            quant.per_token_group_quant_fp8(x, 128, dtype=fp8_dtype)
        elif name == "fused_input_quant":  # norms and SiLU-and-multiply writing fp8
            fused = importlib.import_module(f"{FP8_KERNELS}.fused_input")
            weight = torch.empty(HIDDEN, dtype=BF16)
            gate_up = torch.empty(16, 2 * HIDDEN, dtype=BF16)
            static = torch.ones(1, dtype=torch.float32)
            for mode in ("token", "group", "static", "tensor"):
                scale = static if mode == "static" else None
                fused.rms_norm_quant(x, weight, 1e-5, mode, fp8_dtype, None, scale)
                fused.rms_norm_quant(x, weight, 1e-5, mode, fp8_dtype, torch.empty_like(x), scale)
                fused.silu_and_mul_quant(gate_up, mode, fp8_dtype, scale)
        elif name == "block_scaled_mm":
            block_gemm = importlib.import_module(f"{FP8_KERNELS}.block_gemm")
            a = torch.empty(16, HIDDEN, dtype=fp8_dtype)
            b = torch.empty(HIDDEN, HIDDEN, dtype=fp8_dtype)
            blocks = torch.empty(HIDDEN // 128, HIDDEN // 128, dtype=torch.float32)
            a_scales = torch.empty(16, HIDDEN // 128, dtype=torch.float32)
            block_gemm.block_scaled_mm(a, a_scales, b, blocks, BF16)

    return run


# case name → (package, the modules whose kernels it launches, the case, the targets it runs on)
ALL = tuple(AMD_TARGETS)
ATTENTION = "pagellm_triton_attn.kernels"
OPS = "pagellm_cuda.ops"
FP8_KERNELS = "pagellm_fp8.kernels"
FP8_NAMES = (
    "per_token_quant",
    "per_tensor_quant",
    "per_token_group_quant",
    "fused_input_quant",
    "block_scaled_mm",
)
CASES: dict[str, tuple[str, Case, tuple[str, ...]]] = {
    "attn.write_kv_cache.bf16": (ATTENTION, kv_write(BF16, BF16), ALL),
    "attn.paged_attention.bf16": (ATTENTION, mixed(BF16, BF16), ALL),
    "attn.paged_attention.fp32": (ATTENTION, mixed(torch.float32, torch.float32), ALL),
    "attn.paged_decode.bf16": (ATTENTION, decode(BF16, BF16), ALL),
    "attn.paged_decode.bf16.head256": (ATTENTION, decode(BF16, BF16, head=256), ALL),
    # An fp8 KV cache only where the GPU computes in float8_e4m3fn (see pagellm_rocm.platform).
    "attn.write_kv_cache.fp8": (ATTENTION, kv_write(BF16, FP8), ("gfx950",)),
    "attn.paged_attention.fp8": (ATTENTION, mixed(BF16, FP8), ("gfx950",)),
    "attn.paged_decode.fp8": (ATTENTION, decode(BF16, FP8), ("gfx950",)),
    **{
        f"ops.{name}": (OPS, op(name), ALL)
        for name in (
            "rms_norm",
            "fused_add_rms_norm",
            "per_head_rms_norm",
            "rotary_embedding",
            "qk_norm_rotary",
            "silu_and_mul",
            "write_paged_kv",
        )
    },
    # pagellm-fp8 computes in the GPU's own fp8 format (`RocmPlatform.fp8_dtype`).
    **{f"fp8.{name}.fnuz": (FP8_KERNELS, fp8(name, FNUZ), ("gfx942",)) for name in FP8_NAMES},
    **{f"fp8.{name}.fn": (FP8_KERNELS, fp8(name, FP8), ("gfx950",)) for name in FP8_NAMES},
}

# The modules whose module-level kernels the host functions launch.
KERNEL_MODULES = {
    ATTENTION: {
        "kv_write": ["_write_kv_kernel"],
        "mixed_batch": ["_paged_attention_kernel"],
        "split_kv_decode": ["_paged_decode_kernel", "_merge_splits_kernel"],
    },
    OPS: {
        "layernorm": ["_rms_norm_kernel"],
        "rotary": ["_rotary_kernel"],
        "qk_norm_rotary": ["_qk_norm_rotary_kernel"],
        "activation": ["_silu_and_mul_kernel"],
        "kv_write": ["_write_paged_kv_kernel"],
    },
    FP8_KERNELS: {
        "quant": [
            "_per_token_quant_kernel",
            "_amax_kernel",
            "_row_amax_kernel",
            "_per_tensor_quant_kernel",
            "_per_group_quant_kernel",
        ],
        "one_launch": ["_per_tensor_quant_one_launch_kernel"],
        "fused_input": ["_rms_norm_quant_kernel", "_silu_and_mul_quant_kernel"],
        "block_gemm": ["_block_scaled_mm_kernel"],
    },
}


def record(package: str, case: Case, target) -> list:
    """The launches ``case`` makes for ``target``, recorded from every kernel module."""
    import contextlib
    import importlib

    root = importlib.import_module(package)
    with contextlib.ExitStack() as stack:
        launches: list = []
        for module_name, kernels in KERNEL_MODULES[package].items():
            module = importlib.import_module(f"{package}.{module_name}")
            launches.append(stack.enter_context(recorded_launches(module, *kernels)))
        case(root, target)
    return [launch for per_module in launches for launch in per_module]


def main(archs: list[str]) -> dict:
    results = []
    for arch in archs:
        target = AMD_TARGETS[arch]
        for name, (package, case, where) in CASES.items():
            if arch not in where:
                continue
            launches = record(package, case, target)
            if not launches:
                results.append({"case": name, "arch": arch, "error": "launched no kernel"})
            for launch in launches:
                try:
                    compiled = compile_launch(launch, target)
                    results.append({"case": name, **compiled.__dict__})
                except CrossCompileError as exc:
                    results.append({"case": name, "arch": arch, "kernel": launch.name,
                                    "error": str(exc)})  # fmt: skip
    return {"results": results}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:] or list(AMD_TARGETS))))
