"""int4 weight-only (W4A16) GEMMs of one Llama-3.1-8B decoder layer on the GPU, next to bf16.

The layer's four matmuls (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096)
at M = 1, 16, 64, 256, 1,024, 8,192 tokens, group size 128, each with:

- ``bf16``: ``F.linear`` on bf16 weights;
- ``int4``: pagellm-int4's path for that M (``pagellm_int4.gemm``: the fused Triton W4A16 GEMM up
  to ``FUSED_MAX_M`` rows, else dequantize + cuBLAS);
- ``fused`` and ``dequant_mm``: both paths at every M, so the crossover can be read off.

``triton.testing.do_bench`` medians (L2 flushed between runs); ``GB/s`` is the packed weight's
bytes (int32 words, float32 scales, uint8 zeros) over the time, bf16's its bf16 bytes;
``rel_err`` is ||int4 out - bf16 out of the same dequantized weights|| / ||bf16 out||.

Prints one table line per (matmul, M), then one JSON object (also written to ``--output-json``).

    python benchmarks/int4_gemm.py [--ms 1 16 64 256 1024 8192] [--group-size 128]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.testing

try:
    from pagellm_int4 import gemm as int4_gemm
except ImportError:  # pagellm-int4 not pip-installed: import it from the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins/quantization/int4"))
    from pagellm_int4 import gemm as int4_gemm
from pagellm_int4.int4_values import Int4Values
from pagellm_int4.kernel_layout import KernelLayout, dequantize, to_kernel_layout
from pagellm_int4.kernels import w4a16

LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = [1, 16, 64, 256, 1024, 8192]
DEVICE = "cuda"


def median_us(fn: Callable[[], object]) -> float:
    return 1000.0 * triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


def random_layout(n: int, k: int, group: int) -> KernelLayout:
    groups = k // group
    values = Int4Values(
        q=torch.randint(0, 16, (k, n), dtype=torch.uint8, device=DEVICE),
        zeros=torch.full((groups, n), 8, dtype=torch.uint8, device=DEVICE),
        scales=torch.rand(groups, n, device=DEVICE) * 0.002 + 0.001,
        g_idx=torch.arange(k, device=DEVICE) // group,
    )
    return to_kernel_layout(values, group, "bench")


def packed_bytes(layout: KernelLayout) -> int:
    return sum(t.numel() * t.element_size() for t in (layout.qweight, layout.scales, layout.zeros))


def time_paths(
    x: torch.Tensor,
    weight: torch.Tensor,
    layout: KernelLayout,
    path: Callable[[torch.Tensor, KernelLayout], torch.Tensor],
) -> dict[str, float]:
    group, k = layout.group_size, layout.in_features
    return {
        "bf16": median_us(lambda: F.linear(x, weight)),
        "int4": median_us(lambda: path(x, layout)),
        "fused": median_us(
            lambda: w4a16.w4a16_gemm(x, layout.qweight, layout.scales, layout.zeros, group)
        ),
        "dequant_mm": median_us(
            lambda: torch.mm(
                x,
                w4a16.dequantize_int4(
                    layout.qweight, layout.scales, layout.zeros, group, k, torch.bfloat16
                ),
            )
        ),
    }


def time_layer(name: str, n: int, k: int, ms: list[int], group: int) -> list[dict[str, Any]]:
    layout = random_layout(n, k, group)
    weight = dequantize(layout, torch.bfloat16).t().contiguous()  # [N, K], the same weights
    _, path = int4_gemm.choose_gemm(torch.device(DEVICE))
    int4_bytes, bf16_bytes = packed_bytes(layout), weight.numel() * 2
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        ref = F.linear(x, weight)
        out = path(x, layout)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        timings = time_paths(x, weight, layout, path)
        row: dict[str, Any] = {"layer": name, "N": n, "K": k, "M": m, "rel_err": round(err, 5)}
        for key, us in timings.items():
            moved = bf16_bytes if key == "bf16" else int4_bytes
            row[key] = {"us": round(us, 2), "GB/s": round(moved / us / 1e3, 1)}
        row["int4_speedup"] = round(timings["bf16"] / timings["int4"], 2)
        rows.append(row)
        print(
            f"{name:8s} M={m:5d}: bf16 {timings['bf16']:8.1f} us, int4 {timings['int4']:8.1f} us "
            f"({row['int4']['GB/s']:7.1f} GB/s packed, x{row['int4_speedup']}), fused "
            f"{timings['fused']:8.1f} us, dequant+mm {timings['dequant_mm']:8.1f} us, "
            f"rel_err {err:.1e}",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", type=int, nargs="+", default=MS)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    rows = []
    for name, (n, k) in LAYERS.items():
        rows.extend(time_layer(name, n, k, args.ms, args.group_size))
    report = {
        "benchmark": "int4_gemm",
        "workload": (
            "Llama-3.1-8B decoder layer matmuls (qkv, o, gate_up, down), bf16 activations, "
            f"int4 weights in groups of {args.group_size}"
        ),
        "fused_max_m": int4_gemm.FUSED_MAX_M,
        "machine": {
            "gpu": torch.cuda.get_device_name(),
            "capability": list(torch.cuda.get_device_capability()),
            "host": platform.node(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": triton.__version__,
        },
        "gemms": rows,
    }
    text = json.dumps(report)
    print(text)
    if args.output_json:
        args.output_json.write_text(text + "\n")


if __name__ == "__main__":
    main()
