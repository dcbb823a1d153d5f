"""GGUF matmuls of one Llama-3.1-8B decoder layer on the GPU, next to bf16.

The layer's four matmuls (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096)
at M = 1, 16, 256, 8,192 tokens: ``bf16`` is ``F.linear`` on bf16 weights; each GGUF block type
(Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) is pagellm-gguf's ``gguf_linear`` on random blocks of that
type (the dequantizing Triton matmul up to ``DECODE_MAX_M`` rows, dequantize + cuBLAS above).
``triton.testing.do_bench`` medians; ``weight_gbps`` is the packed weight bytes over the time.

Prints one line per (type, matmul, M), then one JSON object (also written to ``--output-json``).

    python benchmarks/gguf_gemm.py [--ms 1 16 256 8192] [--output-json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins/quantization/gguf"))

from pagellm_gguf.block_types import KERNEL_TYPES, block_shape, type_name  # noqa: E402
from pagellm_gguf.ops import DECODE_MAX_M, gguf_linear  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# Byte offsets of each block type's float16 scale fields: set to a small finite value.
F16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def _us(fn: Any) -> float:
    return 1000.0 * triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


def random_blocks(qtype: int, n: int, k: int) -> torch.Tensor:
    block_size, type_size = block_shape(qtype)
    raw = torch.randint(0, 256, (n, k // block_size, type_size), dtype=torch.uint8, device="cuda")
    scale = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8).cuda()
    for at in F16_FIELDS[type_name(qtype)]:
        raw[..., at : at + 2] = scale
    return raw.reshape(n, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 16, 256, 8192])
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    results: list[dict[str, Any]] = []
    for shape, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        blocks = {int(t): random_blocks(int(t), n, k) for t in KERNEL_TYPES}
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            bf16_us = _us(lambda x=x, w=weight: F.linear(x, w))
            row = {"shape": shape, "n": n, "k": k, "m": m, "bf16_us": round(bf16_us, 2)}
            for qtype, raw in blocks.items():
                us = _us(lambda x=x, raw=raw, qtype=qtype: gguf_linear(x, raw, qtype))
                name = type_name(qtype)
                row[f"{name}_us"] = round(us, 2)
                row[f"{name}_speedup_vs_bf16"] = round(bf16_us / us, 3)
                row[f"{name}_weight_gbps"] = round(raw.numel() / us / 1e3, 1)
            results.append(row)
            print(
                f"{shape:8} M={m:5}  bf16 {bf16_us:9.1f} us  "
                + "  ".join(f"{type_name(t)} {row[f'{type_name(t)}_us']:9.1f}" for t in blocks),
                flush=True,
            )
        del weight, blocks
        torch.cuda.empty_cache()
    report = {
        "benchmark": "gguf_gemm",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "decode_max_m": DECODE_MAX_M,
        "results": results,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.output_json:
        Path(args.output_json).write_text(text + "\n")


if __name__ == "__main__":
    main()
