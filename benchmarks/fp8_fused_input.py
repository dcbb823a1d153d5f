"""FP8 input quantization fused into its producers, against the unfused pair, on the GPU.

For one Llama-3.1-8B decoder layer's three producers (the residual-add RMSNorm before qkv and
before gate_up, 4,096 wide, and SiLU-and-multiply before down, 14,336 wide) at M = 1, 16, 64,
200, 256, 1,024, 8,192 tokens and each activation scale (``token``: per token, ``tensor``: dynamic per
tensor, ``group``: per token and 128 columns):

- ``unfused_us``: the CUDA platform's kernel (`pagellm_cuda.ops`), then pagellm-fp8's
  quantization kernel (per tensor: the row maxima, then the quantization);
- ``unfused_one_launch_us`` (``tensor``): the same with the one-launch per-tensor quantization;
- ``fused_us``: `pagellm_fp8.kernels.fused_input` (one launch; per tensor two).

Each pipeline runs 20 times inside one CUDA graph (how a decode step runs them: launch gaps
included, host overhead not), replayed by ``triton.testing.do_bench`` (median, L2 flushed between
replays); the figures are per run. ``step_saving_us`` sums, per M and mode, (unfused - fused)
over the three producers times 32 layers: the saving of one step of M tokens (W1 decodes 200
rows a step; its prefill steps are 8,192 tokens).

    python benchmarks/fp8_fused_input.py [--ms 1 16 64 200 256 1024 8192] [--output-json out.json]
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
import triton
import triton.testing

ROOT = Path(__file__).resolve().parents[1]
try:
    from pagellm_cuda.ops import CUSTOM_OPS
    from pagellm_fp8.kernels import fused_input, quant
except ImportError:  # the plugins not pip-installed: import them from the source tree
    sys.path[:0] = [str(ROOT / "plugins/quantization/fp8"), str(ROOT / "plugins/cuda_platform")]
    from pagellm_cuda.ops import CUSTOM_OPS
    from pagellm_fp8.kernels import fused_input, quant

HIDDEN, INTERMEDIATE, LAYERS = 4096, 14336, 32
MS = [1, 16, 64, 200, 256, 1024, 8192]
MODES = ["token", "tensor", "group"]
FP8 = torch.float8_e4m3fn
REPEATS = 20
EPS = 1e-5


def graph_us(fn: Callable[[], object]) -> float:
    """Microseconds per call of ``fn``, run ``REPEATS`` times in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEATS):
            fn()
    ms = triton.testing.do_bench(graph.replay, warmup=5, rep=50, return_mode="median")
    return 1000.0 * ms / REPEATS


def quantize(x: torch.Tensor, mode: str, one_launch: bool = False) -> object:
    if mode == "token":
        return quant.per_token_quant_fp8(x)
    if mode == "group":
        return quant.per_token_group_quant_fp8(x, 128)
    return quant.per_tensor_quant_fp8(x, one_launch=one_launch)


def pipelines(producer: str, m: int, mode: str) -> dict[str, Callable[[], object]]:
    g = torch.Generator(device="cuda").manual_seed(m)
    if producer == "silu_and_mul":
        x = torch.randn(m, 2 * INTERMEDIATE, device="cuda", generator=g).bfloat16()
        silu = CUSTOM_OPS["silu_and_mul"]
        runs: dict[str, Callable[[], object]] = {
            "unfused_us": lambda: quantize(silu(x), mode),
            "fused_us": lambda: fused_input.silu_and_mul_quant(x, mode, FP8),
        }
        if mode == "tensor":
            runs["unfused_one_launch_us"] = lambda: quantize(silu(x), mode, one_launch=True)
        return runs
    x = torch.randn(m, HIDDEN, device="cuda", generator=g).bfloat16()
    residual = torch.randn(m, HIDDEN, device="cuda", generator=g).bfloat16()
    weight = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    norm = CUSTOM_OPS["fused_add_rms_norm"]
    # The unfused norm writes its output into x and the sum into residual; the fused one the sum
    # into residual. Fresh copies each run keep the values (not the timings) from drifting.
    x0, r0 = x.clone(), residual.clone()

    def unfused(one_launch: bool = False) -> object:
        x.copy_(x0)
        residual.copy_(r0)
        out, _ = norm(x, residual, weight, EPS)
        return quantize(out, mode, one_launch)

    def fused() -> object:
        x.copy_(x0)
        residual.copy_(r0)
        return fused_input.rms_norm_quant(x, weight, EPS, mode, FP8, residual)

    def copies() -> None:
        x.copy_(x0)
        residual.copy_(r0)

    runs = {"unfused_us": unfused, "fused_us": fused, "copies_us": copies}
    if mode == "tensor":
        runs["unfused_one_launch_us"] = lambda: unfused(one_launch=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", type=int, nargs="+", default=MS)
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("needs a CUDA GPU of compute capability 8.9 or more (fp8)")
    rows: list[dict[str, Any]] = []
    for m in args.ms:
        for mode in MODES:
            for producer in ("fused_add_rms_norm", "silu_and_mul"):
                row: dict[str, Any] = {"producer": producer, "mode": mode, "m": m}
                for name, fn in pipelines(producer, m, mode).items():
                    row[name] = round(graph_us(fn), 2)
                copies = row.pop("copies_us", 0.0)  # the norm's input resets, in both pipelines
                for name in ("unfused_us", "fused_us", "unfused_one_launch_us"):
                    if name in row:
                        row[name] = round(row[name] - copies, 2)
                rows.append(row)
                print(row, flush=True)
    savings = []
    for m in args.ms:
        for mode in MODES:
            per = {r["producer"]: r for r in rows if r["m"] == m and r["mode"] == mode}
            layer = 2 * (
                per["fused_add_rms_norm"]["unfused_us"] - per["fused_add_rms_norm"]["fused_us"]
            ) + (per["silu_and_mul"]["unfused_us"] - per["silu_and_mul"]["fused_us"])
            savings.append({"m": m, "mode": mode, "step_saving_us": round(LAYERS * layer, 1)})
    report = {
        "benchmark": "fp8_fused_input",
        "workload": "Llama-3.1-8B producers of linear inputs (2 norms, 1 SiLU-and-mul a layer)",
        "machine": {
            "gpu": torch.cuda.get_device_name(),
            "host": platform.node(),
            "torch": torch.__version__,
            "triton": triton.__version__,
        },
        "producers": rows,
        "step_savings": savings,
    }
    text = json.dumps(report)
    print(text)
    if args.output_json:
        args.output_json.write_text(text + "\n")


if __name__ == "__main__":
    main()
