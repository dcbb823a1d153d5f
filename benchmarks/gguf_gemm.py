"""GGUF matmuls of one Llama-3.1-8B decoder layer on the GPU, next to bf16.

The layer's four matmuls (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096)
at M = 1 ... 8,192 tokens: ``bf16`` is ``F.linear`` on bf16 weights; each GGUF block type (Q4_0,
Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) is pagellm-gguf's ``gguf_linear`` on random blocks of that type
repacked into its planes (the decode matmul up to ``DECODE_MAX_M`` rows, dequantize + cuBLAS
above).

Timing: 20 calls (more if needed to visit every copy) captured in one CUDA graph and replayed, the
median replay divided by the calls, so launch overhead does not hide kernel time; the calls cycle
over copies of the weights totalling more than twice the L2 cache, so each reads its weights from
memory as a decode step does. ``weight_gbps`` is the stored weight bytes over the time.

``--sweep`` also times a handful of decode tile configurations per (type, matmul, M <=
DECODE_MAX_M) and prints the best ones next to the default (``ops.decode_tiles``), to retune it.
Prints one line per (matmul, M), then one JSON object (also written to ``--output-json``).

    python benchmarks/gguf_gemm.py [--ms 1 4 16 32 256 8192] [--types Q4_0 Q4_K] \\
        [--shapes qkv o] [--sweep [--sweep-ms 1 16]] [--output-json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins/quantization/gguf"))

from pagellm_gguf import ops  # noqa: E402
from pagellm_gguf.block_types import KERNEL_TYPES, block_shape, type_name  # noqa: E402
from pagellm_gguf.planes import GGUFPlanes, repack  # noqa: E402

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
COLD_BYTES = 2 * 50 * 2**20  # twice the H100/H200 L2 (50 MiB): copies cycled past it
# (block_n, slab rows = block_k / codes per word, num_warps, num_stages) tried by --sweep with
# tl.dot, and (M <= 4) SWEEP_NO_DOT without, each with ops.k_splits' split count; the default
# tiles also with half and twice their splits.
SWEEP = [
    (32, 32, 4, 3),
    (64, 16, 4, 3),
    (64, 32, 4, 2),
    (64, 32, 4, 4),
    (64, 32, 8, 3),
    (64, 64, 4, 3),
    (128, 16, 4, 3),
    (128, 32, 4, 3),
    (128, 32, 8, 3),
    (256, 16, 8, 3),
    (256, 32, 8, 3),
]
SWEEP_NO_DOT = [(32, 32, 4, 3), (64, 32, 4, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 8, 3)]


def random_blocks(qtype: int, n: int, k: int) -> torch.Tensor:
    block_size, type_size = block_shape(qtype)
    raw = torch.randint(0, 256, (n, k // block_size, type_size), dtype=torch.uint8, device="cuda")
    scale = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8).cuda()
    for at in F16_FIELDS[type_name(qtype)]:
        raw[..., at : at + 2] = scale
    return raw.reshape(n, -1)


def graph_us(fns: list[Callable[[], Any]], calls: int = 20) -> float:
    """Median µs per call of ``calls`` calls cycling over ``fns``, replayed as one CUDA graph."""
    calls = max(calls, len(fns))
    for fn in fns:
        fn()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    del graph
    return statistics.median(times)


def _copies(nbytes: int) -> int:
    return max(1, -(-COLD_BYTES // nbytes))


def _planes_copy(planes: GGUFPlanes) -> GGUFPlanes:
    return GGUFPlanes(
        planes.qtype,
        planes.in_features,
        planes.out_features,
        planes.codes.clone(),
        None if planes.high is None else planes.high.clone(),
        planes.scale.clone(),
        None if planes.bias is None else planes.bias.clone(),
    )


def _nbytes(planes: GGUFPlanes) -> int:
    return sum(t.numel() * t.element_size() for t in planes.tensors().values())


def sweep(
    x: torch.Tensor, copies: list[GGUFPlanes], calls: int
) -> list[tuple[float, ops.DecodeTiles]]:
    """(µs, tiles) of each candidate launch, fastest first."""
    m, k = x.shape
    n, per_word = copies[0].out_features, copies[0].layout.per_word
    default = ops.decode_tiles(m, n, k, copies[0].layout.code_bits, ops._num_sms(x.device))
    candidates = {default, default._replace(splits=max(1, default.splits // 2))}
    candidates.add(default._replace(splits=default.splits * 2))
    block_m = 16 if m <= 16 else 32
    for block_n, rows, warps, stages in SWEEP:
        block_k = rows * per_word
        tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
        splits = ops.k_splits(tiles, triton.cdiv(k, block_k), ops._num_sms(x.device))
        candidates.add(ops.DecodeTiles(block_m, block_n, block_k, splits, warps, stages))
    # Without tl.dot (one row of x per program: M <= 4 is a handful of programs per tile).
    if m <= 4:
        for block_n, rows, warps, stages in SWEEP_NO_DOT:
            block_k = rows * per_word
            tiles = triton.cdiv(n, block_n) * m
            splits = ops.k_splits(tiles, triton.cdiv(k, block_k), ops._num_sms(x.device))
            candidates.add(ops.DecodeTiles(1, block_n, block_k, splits, warps, stages, False))
    timed = []
    for tiles in candidates:
        fns = [lambda p=p, t=tiles: ops.planes_matmul(x, p, t) for p in copies]
        try:
            timed.append((graph_us(fns, calls), tiles))
        except Exception as exc:  # noqa: BLE001 - a candidate that does not run is skipped
            print(f"  {tiles}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    return sorted(timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 4, 16, 32, 256, 8192])
    parser.add_argument("--types", nargs="+", default=[type_name(t) for t in KERNEL_TYPES])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--sweep", action="store_true", help="time decode tile candidates")
    parser.add_argument("--sweep-ms", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    qtypes = [int(t) for t in KERNEL_TYPES if type_name(t) in args.types]
    results: list[dict[str, Any]] = []
    sweeps: list[dict[str, Any]] = []
    for shape in args.shapes:
        n, k = SHAPES[shape]
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        dense = [weight] + [weight.clone() for _ in range(_copies(weight.numel() * 2) - 1)]
        planes: dict[int, list[GGUFPlanes]] = {}
        for qtype in qtypes:
            first = repack(random_blocks(qtype, n, k), qtype, k)
            planes[qtype] = [first] + [
                _planes_copy(first) for _ in range(_copies(_nbytes(first)) - 1)
            ]
        for m in args.ms:
            calls = 20 if m <= 256 else 4  # a large M's outputs stay in the graph's pool
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            bf16_us = graph_us([lambda x=x, w=w: F.linear(x, w) for w in dense[:calls]], calls)
            row = {"shape": shape, "n": n, "k": k, "m": m, "bf16_us": round(bf16_us, 2)}
            for qtype, copies in planes.items():
                used = copies if m <= ops.DECODE_MAX_M else copies[:calls]
                us = graph_us([lambda x=x, p=p: ops.gguf_linear(x, p) for p in used], calls)
                name = type_name(qtype)
                row[f"{name}_us"] = round(us, 2)
                row[f"{name}_speedup_vs_bf16"] = round(bf16_us / us, 3)
                row[f"{name}_weight_gbps"] = round(_nbytes(copies[0]) / us / 1e3, 1)
                if args.sweep and m in args.sweep_ms and m <= ops.DECODE_MAX_M:
                    timed = sweep(x, copies, calls)
                    best_us, best = timed[0]
                    sweeps.append(
                        {
                            "type": name,
                            "shape": shape,
                            "m": m,
                            "default_us": round(us, 2),
                            "ranked": [[round(t, 2), list(c)] for t, c in timed],
                        }
                    )
                    print(
                        f"  sweep {name} {shape} M={m}: default {us:.1f} us, best {best_us:.1f} "
                        f"us {best} ({_nbytes(copies[0]) / best_us / 1e3:.0f} GB/s); next "
                        + ", ".join(f"{t:.1f} {tuple(c)}" for t, c in timed[1:4]),
                        flush=True,
                    )
            results.append(row)
            print(
                f"{shape:8} M={m:5}  bf16 {bf16_us:9.1f} us  "
                + "  ".join(f"{type_name(t)} {row[f'{type_name(t)}_us']:9.1f}" for t in planes),
                flush=True,
            )
        del weight, dense, planes
        torch.cuda.empty_cache()
    report = {
        "benchmark": "gguf_gemm",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "decode_max_m": ops.DECODE_MAX_M,
        "timing": "CUDA graph of 20 calls over L2-cold weight copies, median per call",
        "results": results,
        "sweep": sweeps,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.output_json:
        Path(args.output_json).write_text(text + "\n")


if __name__ == "__main__":
    main()
