"""TRITON_ATTN's split-KV decode kernel over a sweep of tiles, with a bf16 and an FP8 KV cache.

Why: on W1 the FP8 cache made the decode step slower (13.13 against 12.59 ms, docs/benchmarks.md)
though it halves the K/V bytes read, with the tiles chosen for two-byte elements (64 keys of
128: 16 KiB of K per tile in bf16, 8 KiB in fp8). This prints, per cache dtype and shape, GB/s
of K and V read (the cache's own bytes, each once) for every tile of the sweep, the default's
figure, and the best, then one JSON object.

Shapes: 256 rows of 1k context with 16 query / 8 KV heads (the kernel table's), and W1's decode
(200 rows of 768 context, 32 query / 8 KV heads). Head 128; block (page) size 16, or each of
``--block-sizes`` (the shape's name then ends in ``/bsN``).

    python benchmarks/triton_decode_tiles.py [--default-only] [--output-json out.json]
        [--caches float8_e4m3fn] [--block-n 64 128] [--num-warps 4] [--num-stages 2 3]
        [--num-splits 1 2 3 4] [--swap-ab 0 1] [--fp8-mma 0 1] [--block-sizes 16 32 64]

``--num-splits``: W1's decode launch is 200 rows x 8 KV heads = 1,600 programs of equal length;
at three resident programs an SM (132 SMs) that is 4.04 waves, so the fifth wave would run 16
programs on an otherwise idle GPU. Splitting each row's keys over more programs (and merging)
evens the waves out, at the cost of the merge; these figures say whether it pays.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import platform
from typing import Any

import torch
import triton

HEAD = 128
BLOCK_SIZE = 16
SHAPES = {"256x1k 16q/8kv": (256, 1024, 16, 8), "W1 200x768 32q/8kv": (200, 768, 32, 8)}
SWEEP = {"block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4)}


def batch(
    rows: int,
    context: int,
    heads: int,
    kv_heads: int,
    cache_dtype: torch.dtype,
    block_size: int = BLOCK_SIZE,
) -> dict:
    dev = torch.device("cuda")
    pages = -(-context // block_size)
    num_blocks = rows * pages + 1
    table = (torch.randperm(num_blocks - 1, device=dev) + 1).int().view(rows, pages)
    # TRITON_ATTN's layout: [num_blocks, kv_heads, block_size, head] per K and per V.
    kv = (torch.randn(2, num_blocks, kv_heads, block_size, HEAD, device=dev) * 0.5).to(cache_dtype)
    return {
        "query": torch.randn(rows, heads, HEAD, device=dev).bfloat16(),
        "kv": kv,
        "out": torch.empty(rows, heads, HEAD, device=dev).bfloat16(),
        "qsl": torch.arange(rows + 1, dtype=torch.int32, device=dev),
        "seq_lens": torch.full((rows,), context, dtype=torch.int32, device=dev),
        "table": table,
        "bytes": 2 * rows * context * kv_heads * HEAD * kv.element_size(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--default-only", action="store_true", help="time the default tiles only")
    parser.add_argument(
        "--caches", nargs="+", default=["bfloat16", "float8_e4m3fn"], help="cache dtypes to time"
    )
    for name, values in SWEEP.items():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, nargs="+", type=int, default=list(values), help="sweep values")
    for flag, what in (
        ("--swap-ab", "Tiles.swap_ab (1: both products transposed; keys TILE/swap)"),
        ("--fp8-mma", "Tiles.fp8_mma, with swap_ab over an FP8 cache (keys TILE/swap/fp8mma)"),
    ):
        parser.add_argument(flag, nargs="+", type=int, default=[0], choices=[0, 1], help=what)
    parser.add_argument(
        "--num-splits",
        nargs="+",
        type=int,
        default=[1],
        help="split-KV factors to time each tile with (keys TILE/sN beyond 1): whether splitting "
        "a launch of equal rows into more programs evens out its last wave",
    )
    parser.add_argument(
        "--block-sizes",
        nargs="+",
        type=int,
        default=[BLOCK_SIZE],
        help="page sizes to time (an FP8 page of one KV head is block_size x 128 bytes, "
        "contiguous: whether longer runs read faster)",
    )
    args = parser.parse_args()
    from pagellm_triton_attn.kernels.launch import Tiles, decode_tiles, split_kv_cache
    from pagellm_triton_attn.kernels.split_kv_decode import paged_decode, split_scratch

    results: list[dict[str, Any]] = []
    for (name, (rows, context, heads, kv_heads)), dtype, block_size in itertools.product(
        SHAPES.items(), [getattr(torch, c) for c in args.caches], args.block_sizes
    ):
        shape = name if block_size == BLOCK_SIZE else f"{name}/bs{block_size}"
        b = batch(rows, context, heads, kv_heads, dtype, block_size)
        default = decode_tiles(torch.bfloat16, HEAD, dtype)

        # The backend's view of its cache (an FP8 cache's values are stored token-minor).
        b["k"], b["v"] = split_kv_cache(b["kv"])
        # Allocated here, outside the timed calls.
        b["scratch"] = {
            n: split_scratch(rows, heads, HEAD, n, b["out"].device)
            for n in args.num_splits
            if n > 1
        }

        def run(tiles: Tiles, splits: int, b: dict = b, rows: int = rows) -> None:
            paged_decode(
                b["query"], b["k"], b["v"], b["out"], b["qsl"], b["seq_lens"], b["table"],
                num_rows=rows, scale=HEAD**-0.5, sliding_window=None, tiles=tiles,
                num_splits=splits, scratch=b["scratch"].get(splits),
            )  # fmt: skip

        line: dict[str, Any] = {"shape": shape, "cache": str(dtype).split(".")[-1], "tiles": {}}
        base = (
            [default]
            if args.default_only
            else [
                Tiles(*t) for t in itertools.product(args.block_n, args.num_warps, args.num_stages)
            ]
        )
        sweep = [
            dataclasses.replace(t, swap_ab=bool(swap), fp8_mma=bool(mma))
            for t, swap, mma in itertools.product(base, args.swap_ab, args.fp8_mma)
            if not mma or (swap and dtype == torch.float8_e4m3fn)
        ]
        for tiles, splits in itertools.product(sweep, args.num_splits):
            key = f"{tiles.block_n}/{tiles.num_warps}/{tiles.num_stages}"
            key += "/swap" if tiles.swap_ab else ""
            key += "/fp8mma" if tiles.fp8_mma else ""
            key += f"/s{splits}" if splits > 1 else ""
            try:
                ms = triton.testing.do_bench(
                    lambda t=tiles, n=splits: run(t, n), warmup=25, rep=100
                )
            except Exception as exc:  # out of shared memory or registers: say so, go on
                line["tiles"][key] = f"{type(exc).__name__}"
                continue
            line["tiles"][key] = round(b["bytes"] / ms / 1e6, 1)
        measured = {k: v for k, v in line["tiles"].items() if isinstance(v, float)}
        line["default"] = f"{default.block_n}/{default.num_warps}/{default.num_stages}"
        line["best"] = max(measured, key=measured.get) if measured else None
        print(
            f"{shape:20s} {line['cache']:14s} default {line['default']}: "
            f"{line['tiles'].get(line['default'])} GB/s; best {line['best']}: "
            f"{measured.get(line['best'])} GB/s",
            flush=True,
        )
        results.append(line)
    report = {
        "benchmark": "triton_decode_tiles",
        "machine": {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
        },
        "results": results,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
