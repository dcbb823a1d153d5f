"""The bf16 decode GEMMs of W1 and W2 (Llama-3.1-8B and Qwen3-0.6B shapes) on the GPU, with
cuBLAS's default choice, with cuBLASLt preferred, and with PyTorch's TunableOp (which times the
cuBLASLt algorithms for each shape and keeps the fastest).

Timing: the calls, each on its own copy of the weights (more than 256 MB in all, so no call finds
its weights in L2, as in a decode step), captured in one CUDA graph and replayed; the median
replay divided by the calls. ``tflops`` and ``weight_tbps`` are the achieved rates.

    python benchmarks/decode_gemm.py [--ms 200 256] [--models llama-3.1-8b] [--output-json F]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# (N, K) of each linear: x [M, K] @ W[N, K]^T.
SHAPES = {
    "llama-3.1-8b": {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
        "lm_head": (128256, 4096),
    },
    "qwen3-0.6b": {
        "qkv": (4096, 1024),
        "o": (1024, 2048),
        "gate_up": (6144, 1024),
        "down": (1024, 3072),
        "lm_head": (151936, 1024),
    },
}
L2_FLUSH_BYTES = 256 << 20


def graph_us(calls: list[Callable[[], object]], replays: int = 7) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / len(calls))
    del graph
    return sorted(times)[len(times) // 2]


def time_linear(x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    calls = [lambda w=w: F.linear(x, w) for w in weights]
    return graph_us(calls * max(1, 20 // len(calls)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ms", type=int, nargs="+", default=[200, 256])
    parser.add_argument("--models", nargs="+", default=list(SHAPES))
    parser.add_argument("--tuning-ms", type=int, default=100, help="TunableOp's budget per shape")
    parser.add_argument("--output-json")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    for model in args.models:
        for name, (n, k) in SHAPES[model].items():
            copies = max(2, -(-L2_FLUSH_BYTES // (n * k * 2)))
            weights = [
                torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)
            ]
            for m in args.ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                row: dict[str, Any] = {"model": model, "linear": name, "m": m, "n": n, "k": k}
                ref = F.linear(x, weights[0]).float()
                for method in ("cublas", "cublaslt", "tunable"):
                    torch.backends.cuda.preferred_blas_library(
                        "cublaslt" if method != "cublas" else "cublas"
                    )
                    if method == "tunable":
                        torch.cuda.tunable.enable(True)
                        torch.cuda.tunable.tuning_enable(True)
                        torch.cuda.tunable.set_max_tuning_duration(args.tuning_ms)
                        F.linear(x, weights[0])  # tunes this shape
                        torch.cuda.synchronize()
                        torch.cuda.tunable.tuning_enable(False)
                    err = (F.linear(x, weights[0]).float() - ref).abs().max().item()
                    us = time_linear(x, weights)
                    torch.cuda.tunable.enable(False)
                    row[method] = {
                        "us": round(us, 2),
                        "tflops": round(2 * m * n * k / us / 1e6, 1),
                        "weight_tbps": round(n * k * 2 / us / 1e6, 2),
                        "max_abs_diff": err,
                    }
                torch.backends.cuda.preferred_blas_library("cublas")
                best = min(("cublas", "cublaslt", "tunable"), key=lambda m_: row[m_]["us"])
                row["best"] = best
                row["best_speedup"] = round(row["cublas"]["us"] / row[best]["us"], 3)
                rows.append(row)
                print(
                    f"{model:13s} {name:8s} M={m:4d}: cublas {row['cublas']['us']:8.2f} us  "
                    f"cublaslt {row['cublaslt']['us']:8.2f}  tunable {row['tunable']['us']:8.2f}"
                    f"  ({row['cublas']['tflops']} TFLOP/s, {row['cublas']['weight_tbps']} TB/s)",
                    flush=True,
                )
            del weights
            torch.cuda.empty_cache()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    try:
        out["tunable_results"] = [list(r) for r in torch.cuda.tunable.get_results()]
    except Exception as exc:  # noqa: BLE001 (diagnostic only)
        out["tunable_results"] = repr(exc)
    text = json.dumps(out, indent=1)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
