"""FP8 GEMMs of one Llama-3.1-8B decoder layer on the GPU, next to bf16.

The layer's four matmuls (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096)
at M = 1, 16, 64, 256, 1,024, 8,192 tokens, each with:

- ``bf16``: ``F.linear`` on bf16 weights;
- ``fp8_per_tensor``: ``torch._scaled_mm``, one weight scale and one activation scale;
- ``fp8_rowwise``: ``torch._scaled_mm``, per-output-channel weight scales [1, N] and per-token
  activation scales [M, 1];
- ``fp8_block``: pagellm-fp8's Triton block-scaled GEMM, 128x128 weight blocks and per-token
  groups of 128;
- ``fp8_per_tensor_fast_accum``, ``fp8_rowwise_fast_accum``: with ``use_fast_accum=True`` (the
  FP8 MMAs accumulate without the periodic promotion to float32);
- ``fp8_per_tensor_fast_accum_one_launch``: the same GEMM, its activations quantized by the
  one-launch per-tensor kernel (maxima, grid barrier, quantization in one grid);
- up to M = 256, ``fp8_per_tensor_skinny`` and ``bf16_skinny``: pagellm-fp8's GEMM for decode
  batches (`pagellm_fp8.kernels.skinny_gemm`, the weight as the MMA's M side) on the same
  operands, default tiles; ``--skinny-sweep`` also times every tile of a small sweep and keeps
  each matmul's best (``skinny_sweep`` in the JSON).

Each FP8 scheme is timed twice: the GEMM alone on activations already quantized (``gemm_us``),
and with the fused activation quantization it needs in a linear layer (``linear_us``: per-tensor,
per-token or per-group kernel + GEMM). The per-token quantization kernel is also timed against
the same formula in plain torch ops. ``triton.testing.do_bench`` medians (L2 flushed between
runs), TFLOP/s = 2MNK / time; ``rel_err`` is ||out - bf16 out|| / ||bf16 out||, a check that each
scheme computes the layer. Needs compute capability >= 8.9 (fp8 tensor cores).

Prints one table line per (matmul, M), the per-M sums over the four matmuls, then one JSON
object (also written to ``--output-json``).

    python benchmarks/fp8_gemm.py [--ms 1 16 64 256 1024 8192] [--skinny-sweep]
        [--output-json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.testing

try:
    from pagellm_fp8.kernels import block_gemm, quant, skinny_gemm
except ImportError:  # pagellm-fp8 not pip-installed: import it from the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins/quantization/fp8"))
    from pagellm_fp8.kernels import block_gemm, quant, skinny_gemm

LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = [1, 16, 64, 256, 1024, 8192]
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
DEVICE = "cuda"


def median_us(fn: Callable[[], object]) -> float:
    return 1000.0 * triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


def torch_per_token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token quantization in plain torch ops (what the fused kernel replaces)."""
    scale = (x.float().abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=quant.MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def block_quant_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] (N, K multiples of 128 here) per 128x128 block: (q, scales [N/128, K/128])."""
    n, k = w.shape
    tiles = w.float().view(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scales = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=quant.MIN_SCALE)
    q = (tiles / scales[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(n, k)
    return q, scales


def tflops(m: int, n: int, k: int, us: float) -> float:
    return round(2 * m * n * k / us / 1e6, 1)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return round(((out.float() - ref.float()).norm() / ref.float().norm()).item(), 4)


@dataclass(frozen=True)
class Fp8Weights:
    """One bf16 weight quantized for each FP8 scheme."""

    tensor: torch.Tensor
    tensor_scale: torch.Tensor  # [1]
    row: torch.Tensor
    row_scales: torch.Tensor  # [1, N]
    block: torch.Tensor
    block_scales: torch.Tensor  # [N / 128, K / 128]
    bf16: torch.Tensor  # the weight itself

    @classmethod
    def of(cls, w: torch.Tensor) -> Fp8Weights:
        tensor, tensor_scale = quant.per_tensor_quant_fp8(w)
        row, row_scales = quant.per_token_quant_fp8(w)  # one scale per output channel
        block, block_scales = block_quant_weight(w)
        return cls(
            tensor,
            tensor_scale,
            row,
            row_scales.reshape(1, -1).contiguous(),
            block,
            block_scales,
            w,
        )


Run = Callable[[], torch.Tensor]


def fp8_schemes(x: torch.Tensor, w: Fp8Weights) -> dict[str, tuple[Run, Run]]:
    """Per scheme, (the GEMM on ``x`` quantized beforehand, the linear layer: quantize + GEMM)."""
    bf16 = torch.bfloat16
    xq_t, xs_t = quant.per_tensor_quant_fp8(x)
    xq_r, xs_r = quant.per_token_quant_fp8(x)
    xq_b, xs_b = quant.per_token_group_quant_fp8(x, BLOCK)

    def per_tensor() -> torch.Tensor:
        xq, xs = quant.per_tensor_quant_fp8(x)
        return torch._scaled_mm(xq, w.tensor.t(), xs, w.tensor_scale, out_dtype=bf16)

    def rowwise() -> torch.Tensor:
        xq, xs = quant.per_token_quant_fp8(x)
        return torch._scaled_mm(xq, w.row.t(), xs, w.row_scales, out_dtype=bf16)

    def per_tensor_fast_accum() -> torch.Tensor:
        xq, xs = quant.per_tensor_quant_fp8(x)
        return torch._scaled_mm(
            xq, w.tensor.t(), xs, w.tensor_scale, out_dtype=bf16, use_fast_accum=True
        )

    def rowwise_fast_accum() -> torch.Tensor:
        xq, xs = quant.per_token_quant_fp8(x)
        return torch._scaled_mm(
            xq, w.row.t(), xs, w.row_scales, out_dtype=bf16, use_fast_accum=True
        )

    def per_tensor_one_launch() -> torch.Tensor:
        xq, xs = quant.per_tensor_quant_fp8(x, one_launch=True)
        return torch._scaled_mm(
            xq, w.tensor.t(), xs, w.tensor_scale, out_dtype=bf16, use_fast_accum=True
        )

    def per_tensor_skinny() -> torch.Tensor:
        xq, xs = quant.per_tensor_quant_fp8(x)
        return skinny_gemm.skinny_gemm(xq, w.tensor, xs, w.tensor_scale)

    schemes: dict[str, tuple[Run, Run]] = {
        "fp8_per_tensor": (
            lambda: torch._scaled_mm(xq_t, w.tensor.t(), xs_t, w.tensor_scale, out_dtype=bf16),
            per_tensor,
        ),
        "fp8_per_tensor_fast_accum": (
            lambda: torch._scaled_mm(
                xq_t, w.tensor.t(), xs_t, w.tensor_scale, out_dtype=bf16, use_fast_accum=True
            ),
            per_tensor_fast_accum,
        ),
        "fp8_per_tensor_fast_accum_one_launch": (
            lambda: torch._scaled_mm(
                xq_t, w.tensor.t(), xs_t, w.tensor_scale, out_dtype=bf16, use_fast_accum=True
            ),
            per_tensor_one_launch,
        ),
        "fp8_rowwise": (
            lambda: torch._scaled_mm(xq_r, w.row.t(), xs_r, w.row_scales, out_dtype=bf16),
            rowwise,
        ),
        "fp8_rowwise_fast_accum": (
            lambda: torch._scaled_mm(
                xq_r, w.row.t(), xs_r, w.row_scales, out_dtype=bf16, use_fast_accum=True
            ),
            rowwise_fast_accum,
        ),
        "fp8_block": (
            lambda: block_gemm.block_scaled_mm(xq_b, xs_b, w.block, w.block_scales),
            lambda: block_gemm.block_scaled_linear(x, w.block, w.block_scales),
        ),
    }
    if x.shape[0] <= skinny_gemm.MAX_M:
        schemes["fp8_per_tensor_skinny"] = (
            lambda: skinny_gemm.skinny_gemm(xq_t, w.tensor, xs_t, w.tensor_scale),
            per_tensor_skinny,
        )
        schemes["bf16_skinny"] = (
            lambda: skinny_gemm.skinny_gemm(x, w.bf16),
            lambda: skinny_gemm.skinny_gemm(x, w.bf16),
        )
    return schemes


SKINNY_SWEEP = [
    skinny_gemm.SkinnyTiles(block_n=bn, block_k=0, num_warps=nw, num_stages=ns, split_k=sk)
    for bn, nw in ((32, 4), (64, 4), (128, 8))
    for ns in (3, 4)
    for sk in (1, 2, 4)
]


def skinny_sweep(x: torch.Tensor, w: Fp8Weights) -> dict[str, Any]:
    """Per operand type, every tile of ``SKINNY_SWEEP`` (GEMM alone, µs) and the best."""
    xq, xs = quant.per_tensor_quant_fp8(x)
    out: dict[str, Any] = {}
    for kind, (a, b, scales) in {
        "fp8": (xq, w.tensor, (xs, w.tensor_scale)),
        "bf16": (x, w.bf16, (None, None)),
    }.items():
        timings: dict[str, Any] = {}
        for t in SKINNY_SWEEP:
            tiles = dataclasses.replace(t, block_k=128 // a.element_size())
            key = f"{t.block_n}/{t.num_warps}/{t.num_stages}" + (
                f"/k{t.split_k}" if t.split_k > 1 else ""
            )
            try:
                run = partial(skinny_gemm.skinny_gemm, a, b, *scales, tiles=tiles)
                timings[key] = round(median_us(run), 2)
            except Exception as e:  # out of shared memory: say so, go on
                timings[key] = f"{type(e).__name__}"
        measured = {k: v for k, v in timings.items() if isinstance(v, float)}
        best = min(measured, key=measured.get) if measured else None
        out[kind] = {"us": timings, "best": best, "best_us": measured.get(best)}
    return out


def time_scheme(
    gemm: Run, linear: Run, ref: torch.Tensor, m: int, n: int, k: int
) -> dict[str, Any]:
    try:
        err = rel_err(linear(), ref)
        gemm_us, linear_us = median_us(gemm), median_us(linear)
    except Exception as e:  # a scheme this torch, Triton or GPU does not run: the JSON says why
        return {"error": f"{type(e).__name__}: {str(e).strip()[:300]}"}
    return {
        "gemm_us": round(gemm_us, 2),
        "gemm_tflops": tflops(m, n, k, gemm_us),
        "linear_us": round(linear_us, 2),
        "linear_tflops": tflops(m, n, k, linear_us),
        "rel_err": err,
    }


def time_layer(
    name: str, n: int, k: int, ms: list[int], sweep: bool = False
) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02
    fp8_w = Fp8Weights.of(w)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        ref = F.linear(x, w)
        us = median_us(partial(F.linear, x, w))
        result: dict[str, Any] = {"matmul": name, "M": m, "N": n, "K": k}
        result["bf16"] = {"us": round(us, 2), "tflops": tflops(m, n, k, us)}
        cells = [f"bf16 {result['bf16']['tflops']:7.1f}"]
        for scheme, (gemm, linear) in fp8_schemes(x, fp8_w).items():
            r = result[scheme] = time_scheme(gemm, linear, ref, m, n, k)
            cells.append(
                f"{scheme} error"
                if "error" in r
                else f"{scheme} {r['gemm_tflops']:7.1f} ({r['linear_tflops']:7.1f})"
            )
        print(f"{name:8s} M={m:5d}  TFLOP/s gemm (linear): " + "  ".join(cells), flush=True)
        if sweep and m <= skinny_gemm.MAX_M:
            result["skinny_sweep"] = skinny_sweep(x, fp8_w)
            print(
                f"{name:8s} M={m:5d}  skinny sweep best: "
                + ", ".join(
                    f"{kind} {r['best']} {r['best_us']} us"
                    for kind, r in result["skinny_sweep"].items()
                ),
                flush=True,
            )
        rows.append(result)
    return rows


def quant_timings(ms: list[int]) -> list[dict[str, Any]]:
    rows = []
    for k in sorted({k for _, k in LAYERS.values()}):
        for m in ms:
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            fused = median_us(partial(quant.per_token_quant_fp8, x))
            torch_ops = median_us(partial(torch_per_token_quant, x))
            group = median_us(partial(quant.per_token_group_quant_fp8, x, BLOCK))
            tensor = median_us(partial(quant.per_tensor_quant_fp8, x))
            rows.append(
                {
                    "M": m,
                    "K": k,
                    "per_token_fused_us": round(fused, 2),
                    "per_token_torch_ops_us": round(torch_ops, 2),
                    "per_group_fused_us": round(group, 2),
                    "per_tensor_fused_us": round(tensor, 2),
                }
            )
            print(
                f"quant K={k:5d} M={m:5d}: per-token fused {fused:7.1f} us, torch ops "
                f"{torch_ops:7.1f} us; per-group {group:7.1f} us; per-tensor {tensor:7.1f} us",
                flush=True,
            )
    return rows


def layer_sums(rows: list[dict[str, Any]], ms: list[int]) -> list[dict[str, Any]]:
    """Per M, the four matmuls' times added up: one decoder layer's linear layers."""
    sums = []
    for m in ms:
        at_m = [r for r in rows if r["M"] == m]
        entry: dict[str, Any] = {"M": m, "bf16_us": round(sum(r["bf16"]["us"] for r in at_m), 2)}
        schemes = [key for key, v in at_m[0].items() if isinstance(v, dict) and key != "bf16"]
        for scheme in [s for s in schemes if s != "skinny_sweep"]:
            if all(scheme in r and "error" not in r[scheme] for r in at_m):
                entry[f"{scheme}_linear_us"] = round(sum(r[scheme]["linear_us"] for r in at_m), 2)
        sums.append(entry)
        print(
            f"layer  M={m:5d}: " + ", ".join(f"{key} {v}" for key, v in entry.items() if key != "M")
        )
    return sums


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", type=int, nargs="+", default=MS)
    parser.add_argument("--output-json", type=Path)
    parser.add_argument(
        "--skinny-sweep", action="store_true", help="time the skinny GEMM's tiles too (M <= 256)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("needs a CUDA GPU of compute capability 8.9 or more (fp8 tensor cores)")
    rows = []
    for name, (n, k) in LAYERS.items():
        rows.extend(time_layer(name, n, k, args.ms, args.skinny_sweep))
    report = {
        "benchmark": "fp8_gemm",
        "workload": "Llama-3.1-8B decoder layer matmuls (qkv, o, gate_up, down), bf16 activations",
        "machine": {
            "gpu": torch.cuda.get_device_name(),
            "capability": list(torch.cuda.get_device_capability()),
            "host": platform.node(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": triton.__version__,
        },
        "gemms": rows,
        "layer_sums": layer_sums(rows, args.ms),
        "quantization": quant_timings(args.ms),
    }
    text = json.dumps(report)
    print(text)
    if args.output_json:
        args.output_json.write_text(text + "\n")


if __name__ == "__main__":
    main()
