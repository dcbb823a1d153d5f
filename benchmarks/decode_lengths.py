"""TRITON_ATTN's decode kernel on a batch of mixed sequence lengths (W2's decode: lengths spread
over [min, max]), with the rows in batch order, longest first, shortest first, and split-KV.

Why: with every row's K/V read by one program per KV head, a long row dispatched late leaves the
GPU waiting on its last programs. Sorting the rows (longest first) or splitting them bounds that
tail. Prints GB/s of K and V read (each cache byte once) per case, then one JSON object.

    python benchmarks/decode_lengths.py [--rows 256] [--min-len 200] [--max-len 2048]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import triton

HEAD = 128
BLOCK_SIZE = 16


def make_batch(lengths: torch.Tensor, heads: int, kv_heads: int) -> dict[str, Any]:
    dev = torch.device("cuda")
    rows = lengths.numel()
    pages = -(-int(lengths.max()) // BLOCK_SIZE)
    num_blocks = rows * pages + 1
    table = (torch.randperm(num_blocks - 1, device=dev) + 1).int().view(rows, pages)
    kv = (torch.randn(2, num_blocks, kv_heads, BLOCK_SIZE, HEAD, device=dev) * 0.5).bfloat16()
    return {
        "query": torch.randn(rows, heads, HEAD, device=dev).bfloat16(),
        "kv": kv,
        "out": torch.empty(rows, heads, HEAD, device=dev).bfloat16(),
        "qsl": torch.arange(rows + 1, dtype=torch.int32, device=dev),
        "seq_lens": lengths.to(dev, torch.int32),
        "table": table,
        "bytes": 2 * int(lengths.sum()) * kv_heads * HEAD * 2,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=200)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--heads", type=int, nargs=2, default=[16, 8], help="q and kv heads")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    from pagellm_triton_attn.kernels.split_kv_decode import (
        paged_decode,
        rows_longest_first,
        split_scratch,
    )

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.rows,), generator=gen)
    heads, kv_heads = args.heads
    orders = {
        "batch order": lengths,
        "longest first": lengths.sort(descending=True).values,
        "shortest first": lengths.sort().values,
        "uniform (same mean)": torch.full_like(lengths, int(lengths.float().mean())),
    }
    results: dict[str, Any] = {}
    for name, lens in orders.items():
        b = make_batch(lens, heads, kv_heads)
        order = torch.from_numpy(rows_longest_first(lens.numpy())).cuda()
        for splits in (1, 2, 4, -1) if name == "batch order" else (1,):
            ordered, splits = splits < 0, abs(splits)
            scratch = (
                split_scratch(args.rows, heads, HEAD, splits, torch.device("cuda"))
                if splits > 1
                else None
            )

            row_order = order if ordered else None

            def run(
                b: dict = b,
                splits: int = splits,
                scratch: Any = scratch,
                row_order: Any = row_order,
            ) -> None:
                paged_decode(
                    b["query"], b["kv"][0], b["kv"][1], b["out"], b["qsl"], b["seq_lens"],
                    b["table"], num_rows=args.rows, scale=HEAD**-0.5, sliding_window=None,
                    num_splits=splits, scratch=scratch, row_order=row_order,
                )  # fmt: skip

            ms = triton.testing.do_bench(run, warmup=25, rep=200)
            key = name if splits == 1 else f"{name}, {splits} splits"
            key = f"{name}, row_order longest first" if ordered else key
            results[key] = {"us": round(ms * 1e3, 1), "gb_per_s": round(b["bytes"] / ms / 1e6, 1)}
            print(f"{key:28s} {results[key]['us']:8.1f} us {results[key]['gb_per_s']:8.1f} GB/s")
        del b
        torch.cuda.empty_cache()
    report = {
        "benchmark": "decode_lengths",
        "gpu": torch.cuda.get_device_name(),
        "rows": args.rows,
        "lengths": [args.min_len, args.max_len],
        "heads": args.heads,
        "results": results,
    }
    text = json.dumps(report, indent=1)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
