"""FLASH_ATTN's kernels on the GPU, per kernel and per phase, next to TRITON_ATTN's.

Decode: 256 rows of 1k context (1,023 cached tokens + 1 new), 16 query / 8 KV heads of 128,
bf16: GB/s of K and V read (each byte once). Prefill: one 8,192-token prompt, causal, head 128
(16 and 32 query heads / 8 KV heads): TFLOP/s (4 x heads x 128 x 8,192^2 / 2). Each at every
``--block-sizes`` a kernel takes; ``triton.testing.do_bench`` medians. Every importable kernel
is timed through FLASH_ATTN's own builder and kernel objects (the layer's call, without the K/V
write); TRITON_ATTN's kernels over their own KV layout come alongside.

Prints the table lines (the format of docs/benchmarks.md "GPU tests and kernel timings"), the
per-phase choice the shipped measurements make and the one these make, the measurements as
``pagellm_flash_attn/measurements.py`` entries, then one JSON object.

    python benchmarks/flash_attn_kernels.py [--block-sizes 16 128] [--output-json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any
from unittest import mock

import torch

from pagellm.attention.backend import CommonAttentionMetadata
from pagellm.kv_cache.spec import KVCacheSpec

HEAD = 128
DTYPE = torch.bfloat16


def paged_batch(
    num_rows: int, context: int, new: int, num_heads: int, num_kv_heads: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, CommonAttentionMetadata]:
    """(query [T, H, D], FLASH_ATTN's kv_cache [2, blocks, block_size, Hkv, D], common): rows
    of ``context`` cached tokens and ``new`` new ones each, in shuffled blocks."""
    dev = torch.device("cuda")
    seq_len = context + new
    blocks_per_row = -(-seq_len // block_size)
    num_blocks = num_rows * blocks_per_row + 1
    block_table = (torch.randperm(num_blocks - 1, device=dev) + 1).int()
    block_table = block_table.view(num_rows, blocks_per_row)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, HEAD, device=dev).to(DTYPE)
    num_tokens = num_rows * new
    fused = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * HEAD, device=dev).to(DTYPE)
    query = fused[:, : num_heads * HEAD].view(num_tokens, num_heads, HEAD)
    qsl = torch.arange(0, num_tokens + 1, new, dtype=torch.int32, device=dev)
    seq_lens = torch.full((num_rows,), seq_len, dtype=torch.int32, device=dev)
    pos = torch.arange(context, seq_len, device=dev).repeat(num_rows)
    rows = torch.arange(num_rows, device=dev).repeat_interleave(new)
    slots = block_table[rows, pos // block_size].long() * block_size + pos % block_size
    common = CommonAttentionMetadata(
        num_reqs=num_rows,
        num_actual_tokens=num_tokens,
        max_query_len=new,
        max_seq_len=seq_len,
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.cpu(),
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.cpu(),
        block_table=block_table,
        slot_mapping=slots,
    )
    return query, kv_cache, common


def median_ms(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, return_mode="median"))


def usable(name: str, capability: tuple[int, int], block_size: int) -> str | None:
    """None when kernel ``name`` can run these shapes here, else why not."""
    from pagellm_flash_attn.kernels import KERNELS

    kernel = KERNELS[name]
    why = kernel.unavailable_reason() or kernel.unsupported_gpu(capability)
    return why or next(iter(kernel.unsupported_shape(capability, HEAD, block_size)), None)


def flash_builder(prefill: str, decode: str, num_kv_heads: int, block_size: int):
    from pagellm_flash_attn.builder import FlashAttnMetadataBuilder
    from pagellm_flash_attn.phases import DECODE_VAR, PREFILL_VAR

    with mock.patch.dict(os.environ, {PREFILL_VAR: prefill, DECODE_VAR: decode}):
        spec = KVCacheSpec(block_size, num_kv_heads, HEAD, DTYPE)
        return FlashAttnMetadataBuilder(spec, torch.device("cuda"))


def time_flash(
    name: str, phase: str, query, kv_cache, common, heads: tuple[int, int]
) -> float | None:
    from pagellm_flash_attn.kernels import KERNELS, PROVIDERS, LayerParams

    block_size = kv_cache.shape[2]
    capability = torch.cuda.get_device_capability()
    prefill = name
    if not KERNELS[name].serves_prefill:  # any provider: the decode-only step never calls it
        usable_providers = [
            k.name for k in PROVIDERS if usable(k.name, capability, block_size) is None
        ]
        if not usable_providers:
            return None  # FLASH_ATTN cannot start here: no prefill provider is importable
        prefill = usable_providers[0]
    builder = flash_builder(prefill, name, heads[1], block_size)
    meta = builder.build(common)
    layer = LayerParams(heads[0], heads[1], HEAD, HEAD**-0.5, None)
    kc, vc = kv_cache[0], kv_cache[1]
    if phase == "decode":
        kernel = meta.decode_kernel
        return median_ms(lambda: kernel.decode(query, kc, vc, meta, layer, None))
    kernel = meta.prefill_kernel
    return median_ms(lambda: kernel.prefill(query, kc, vc, meta, layer, None))


def time_triton_attn(phase: str, query, kv_cache, common, heads: tuple[int, int]) -> float:
    """TRITON_ATTN's kernels over their own KV layout ([2, blocks, Hkv, block_size, D])."""
    from pagellm_triton_attn import kernels
    from pagellm_triton_attn.backend import TritonAttentionMetadataBuilder

    own = kv_cache.permute(0, 1, 3, 2, 4).contiguous()
    block_size = kv_cache.shape[2]
    spec = KVCacheSpec(block_size, heads[1], HEAD, DTYPE)
    meta = TritonAttentionMetadataBuilder(spec, torch.device("cuda")).build(common)
    out = torch.empty_like(query)
    args = (query, own[0], own[1], out, meta.query_start_loc, meta.seq_lens, meta.block_table)
    if phase == "decode":
        scratch = meta.scratch.get(heads[0], HEAD) if meta.scratch else None
        return median_ms(
            lambda: kernels.paged_decode(
                *args,
                num_rows=meta.num_reqs,
                scale=HEAD**-0.5,
                sliding_window=None,
                num_splits=meta.num_splits,
                scratch=scratch,
            )  # fmt: skip
        )
    return median_ms(
        lambda: kernels.paged_attention(
            *args,
            num_reqs=meta.num_reqs,
            num_tokens=meta.num_actual_tokens,
            max_query_len=meta.max_query_len,
            scale=HEAD**-0.5,
            sliding_window=None,
        )  # fmt: skip
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--output-json", help="also write the JSON object here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from pagellm_flash_attn.kernels import KERNELS
    from pagellm_flash_attn.measurements import MEASUREMENTS, Measurement
    from pagellm_flash_attn.phases import choose_phases

    capability = torch.cuda.get_device_capability()
    gpu = torch.cuda.get_device_name()
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    # phase: (label, rows, cached context, new tokens, (query heads, KV heads)) each.
    workloads = {
        "decode": [("decode 256 rows x 1k ctx, 16q/8kv heads", 256, 1023, 1, (16, 8))],
        "prefill": [(f"prefill 8192 tokens, {h}q/8kv heads", 1, 0, 8192, (h, 8)) for h in (16, 32)],
    }
    for block_size in args.block_sizes:
        for phase, cases in workloads.items():
            for label, num_rows, context, new, heads in cases:
                query, kv_cache, common = paged_batch(num_rows, context, new, *heads, block_size)
                kv_bytes = 2 * num_rows * (context + new) * heads[1] * HEAD * DTYPE.itemsize
                flops = 4 * heads[0] * HEAD * new * new / 2
                names = ["TRITON_ATTN"]
                for name, kernel in KERNELS.items():
                    why = usable(name, capability, block_size)
                    if why:
                        skipped[f"{name} block {block_size}"] = why
                    elif phase == "decode" or kernel.serves_prefill:
                        names.append(name)
                for name in names:
                    if name == "TRITON_ATTN":
                        ms = time_triton_attn(phase, query, kv_cache, common, heads)
                    else:
                        ms = time_flash(name, phase, query, kv_cache, common, heads)
                        if ms is None:
                            skipped[f"{name} block {block_size}"] = "no prefill provider importable"
                            continue
                    value = kv_bytes / ms / 1e6 if phase == "decode" else flops / ms / 1e9
                    unit = "GB/s" if phase == "decode" else "TFLOP/s"
                    rows.append(dict(phase=phase, workload=label, kernel=name, block_size=block_size, us=ms * 1e3, value=value, unit=unit))  # fmt: skip
                del query, kv_cache, common
                torch.cuda.empty_cache()

    lines = [f"{gpu} ({capability[0]}.{capability[1]}), bf16, head 128, do_bench medians; decode GB/s = K+V bytes read / time"]  # fmt: skip
    for r in rows:
        name = f"{r['kernel']}, block {r['block_size']}"
        lines.append(f"{r['workload']:<40} {name:<22} {r['us']:8.1f} us  {r['value']:6.0f} {r['unit']}")  # fmt: skip
    # The measurements table: the first workload of each phase (16 query heads).
    source = f"{gpu}, benchmarks/flash_attn_kernels.py"
    measured = [
        Measurement(r["kernel"], r["phase"], capability, r["block_size"], round(r["value"], 0), source)
        for r in rows
        if r["kernel"] != "TRITON_ATTN" and "16q" in r["workload"]
    ]  # fmt: skip
    choices = {}
    for block_size in args.block_sizes:
        for label, table in (("shipped", MEASUREMENTS), ("measured now", measured)):
            try:
                c = choose_phases(capability, HEAD, block_size, measurements=table)
                choice = f"prefill {c.prefill.name} [{c.prefill_why}], decode {c.decode.name} [{c.decode_why}]"  # fmt: skip
            except ValueError as exc:
                choice = f"none: {exc}"
            choices[f"block {block_size}, {label} measurements"] = choice
            lines.append(f"per-phase choice at block {block_size}, {label} measurements: {choice}")
    lines.append("measurements.py entries:")
    lines += [f"    {m!r}," for m in measured]
    lines += [f"skipped {k}: {v}" for k, v in skipped.items()]
    print("\n".join(lines), file=sys.stderr)
    report = {
        "machine": {"gpu": gpu, "capability": capability, "host": platform.node()},
        "workload": __doc__.split("\n\n")[1].replace("\n", " "),
        "results": rows,
        "choices": choices,
        "measurements": [asdict(m) for m in measured],
        "skipped": skipped,
    }
    text = json.dumps(report)
    print(text)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
