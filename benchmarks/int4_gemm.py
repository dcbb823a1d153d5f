"""int4 weight-only (W4A16) GEMMs of one Llama-3.1-8B decoder layer on the GPU, next to bf16.

The layer's four matmuls (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096)
at M = 1, 16, 64, 256, 1,024, 8,192 tokens, group size 128, each with:

- ``bf16``: ``F.linear`` on bf16 weights;
- ``int4``: pagellm-int4's path for that M (``pagellm_int4.gemm.choose_gemm``: ``cuda_mma``
  where its CUDA kernels build, the CUDA W4A16 GEMM up to ``CUDA_FUSED_MAX_M`` rows, else their
  dequantization + cuBLAS; else ``triton_w4a16``);
- ``cuda`` and ``cuda_dequant_mm``: the CUDA kernels' two ways at every M
  (``cuda_dequant_staged_mm``: the dequantization through shared memory; ``cuda_pdl``: the
  GEMM launched with programmatic dependent launch, sm_90+, where each call's first weight
  loads overlap the end of the call before it, a GEMM here, a norm or attention in a model);
- ``fused`` and ``dequant_mm``: the Triton kernels' two ways at every M (``triton``: the Triton
  path as it chooses), so the crossovers can be read off.

Times are GPU times per call, as a decode step runs them: the calls are captured in one CUDA
graph (no launch gaps), each call on its own copy of the weights, with enough copies (at least
256 MB in all) that every call reads its weight from memory, not from the 60 MB L2; the median of
several replays. ``GB/s`` is the packed weight's bytes (int32 words, float32 scales, uint8 zeros)
over the time, bf16's its bf16 bytes; ``rel_err`` is ||int4 out - bf16 out of the same dequantized
weights|| / ||bf16 out||.

``--sweep`` first measures candidate tiles of the fused kernel for each matmul at
M = 1, 16, 64 (`SWEEP_MS`, or ``--sweep-ms``) and writes the fastest to the kernel's table
(``pagellm_int4/configs/<GPU name>.json``, which `int4_tiles.tile_config` reads; also
``--sweep-json``), then times the table as above with the new entries.

``benchmarks/int4_cuda_sweep.py`` times the CUDA GEMM's launch shapes.

``--probe`` times every tile of a grid instead (kinds ``--probe-kinds``, 64 or 128 columns, splits
1/4/8/16, ``--probe-stages``, ``--probe-chains``), prints each and writes them all to
``--output-json``; no table is written.

Prints one table line per (matmul, M), then one JSON object (also written to ``--output-json``).

    python benchmarks/int4_gemm.py [--ms 1 16 64 256 1024 8192] [--group-size 128] [--sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
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
from pagellm_int4.fragment_layout import FragmentLayout
from pagellm_int4.int4_values import Int4Values
from pagellm_int4.kernel_layout import KernelLayout, dequantize, to_kernel_layout
from pagellm_int4.kernels import tiles as int4_tiles
from pagellm_int4.kernels import w4a16

LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = [1, 16, 64, 256, 1024, 8192]
SWEEP_MS = [1, 16, 64]  # 2..16 rows share the 16-row entry
DEVICE = "cuda"
L2_FLUSH_BYTES = 256 << 20


def copies_for(nbytes: int) -> int:
    return max(2, -(-L2_FLUSH_BYTES // nbytes))


def graph_us(calls: list[Callable[[], object]], replays: int = 5) -> float:
    """GPU microseconds per call: the calls (each on its own weights) captured in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # compile and allocate outside the capture
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


def random_values(n: int, k: int, group: int) -> Int4Values:
    groups = k // group
    return Int4Values(
        q=torch.randint(0, 16, (k, n), dtype=torch.uint8, device=DEVICE),
        zeros=torch.full((groups, n), 8, dtype=torch.uint8, device=DEVICE),
        scales=torch.rand(groups, n, device=DEVICE) * 0.002 + 0.001,
        g_idx=torch.arange(k, device=DEVICE) // group,
    )


def random_layout(n: int, k: int, group: int) -> KernelLayout:
    return to_kernel_layout(random_values(n, k, group), group, "bench")


def packed_bytes(layout: KernelLayout | FragmentLayout) -> int:
    words = layout.words if isinstance(layout, FragmentLayout) else layout.qweight
    return sum(t.numel() * t.element_size() for t in (words, layout.scales, layout.zeros))


def layout_copies(layout: KernelLayout) -> list[KernelLayout]:
    copy = lambda: KernelLayout(  # noqa: E731
        layout.qweight.clone(),
        layout.scales.clone(),
        layout.zeros.clone(),
        None,
        layout.group_size,
        layout.in_features,
    )
    return [layout] + [copy() for _ in range(copies_for(packed_bytes(layout)) - 1)]


def fragment_copies(layout: FragmentLayout) -> list[FragmentLayout]:
    copy = lambda: dataclasses.replace(  # noqa: E731
        layout,
        words=layout.words.clone(),
        scales=layout.scales.clone(),
        zeros=layout.zeros.clone(),
    )
    return [layout] + [copy() for _ in range(copies_for(packed_bytes(layout)) - 1)]


def cuda_kernels() -> Any:
    """The CUDA kernels, or None (and why, printed once) where they do not build."""
    kernels = int4_gemm.cuda_kernels_or_reason(torch.device(DEVICE))
    if isinstance(kernels, str):
        print(f"the CUDA int4 kernels do not run here: {kernels}", flush=True)
        return None
    return kernels


def time_paths(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    layouts: list[KernelLayout],
    fragments: list[FragmentLayout] | None,
) -> dict[str, float]:
    group, k = layouts[0].group_size, layouts[0].in_features

    def fused(lay: KernelLayout) -> torch.Tensor:
        return w4a16.w4a16_gemm(x, lay.qweight, lay.scales, lay.zeros, group)

    def dequant_mm(lay: KernelLayout) -> torch.Tensor:
        w = w4a16.dequantize_int4(lay.qweight, lay.scales, lay.zeros, group, k, torch.bfloat16)
        return torch.mm(x, w)

    triton_path = int4_gemm._triton_gemm(w4a16)
    out = {
        "bf16": graph_us([functools.partial(F.linear, x, w) for w in weights]),
        "triton": graph_us([functools.partial(triton_path, x, lay) for lay in layouts]),
        "fused": graph_us([functools.partial(fused, lay) for lay in layouts]),
        "dequant_mm": graph_us([functools.partial(dequant_mm, lay) for lay in layouts]),
    }
    kernels = cuda_kernels()
    if fragments is not None and kernels is not None:

        def cuda_dequant_mm(lay: FragmentLayout, staged: bool = False) -> torch.Tensor:
            return F.linear(x, kernels.dequantize_t(lay, torch.bfloat16, staged))

        out["cuda"] = graph_us([functools.partial(kernels.gemm, x, lay) for lay in fragments])
        if x.shape[0] <= int4_gemm.CUDA_FUSED_MAX_M and torch.cuda.get_device_capability()[0] >= 9:
            kernels.overlap = True  # programmatic dependent launch (PAGELLM_INT4_PDL=1)
            try:
                out["cuda_pdl"] = graph_us(
                    [functools.partial(kernels.gemm, x, lay) for lay in fragments]
                )
            finally:
                kernels.overlap = False
        out["cuda_dequant_mm"] = graph_us(
            [functools.partial(cuda_dequant_mm, lay) for lay in fragments]
        )
        out["cuda_dequant_staged_mm"] = graph_us(
            [functools.partial(cuda_dequant_mm, lay, True) for lay in fragments]
        )
        cuda_path = int4_gemm._cuda_gemm(kernels)
        out["int4"] = graph_us([functools.partial(cuda_path, x, lay) for lay in fragments])
    else:
        out["int4"] = out["triton"]
    return out


def time_layer(name: str, n: int, k: int, ms: list[int], group: int) -> list[dict[str, Any]]:
    values = random_values(n, k, group)
    layout = to_kernel_layout(values, group, "bench")
    weight = dequantize(layout, torch.bfloat16).t().contiguous()  # [N, K], the same weights
    chosen = int4_gemm.choose_gemm(torch.device(DEVICE), k, group)
    int4_bytes, bf16_bytes = packed_bytes(layout), weight.numel() * 2
    layouts = layout_copies(layout)
    fragments = None
    if chosen.name == "cuda_mma":
        fragments = fragment_copies(chosen.make_layout(values, group, "bench"))
        int4_bytes = packed_bytes(fragments[0])
    weights = [weight] + [weight.clone() for _ in range(copies_for(bf16_bytes) - 1)]
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        ref = F.linear(x, weight)
        out = chosen.run(x, fragments[0] if fragments else layout)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        timings = time_paths(x, weights, layouts, fragments)
        row: dict[str, Any] = {
            "layer": name,
            "N": n,
            "K": k,
            "M": m,
            "path": chosen.name,
            "rel_err": round(err, 5),
        }
        for key, us in timings.items():
            moved = bf16_bytes if key == "bf16" else int4_bytes
            row[key] = {"us": round(us, 2), "GB/s": round(moved / us / 1e3, 1)}
        row["int4_speedup"] = round(timings["bf16"] / timings["int4"], 2)
        rows.append(row)
        cuda = (
            f", cuda {timings['cuda']:8.1f} us, cuda dequant+mm {timings['cuda_dequant_mm']:8.1f}"
            f" (staged {timings['cuda_dequant_staged_mm']:8.1f})"
            + (f", cuda pdl {timings['cuda_pdl']:8.1f}" if "cuda_pdl" in timings else "")
            if "cuda" in timings
            else ""
        )
        print(
            f"{name:8s} M={m:5d}: bf16 {timings['bf16']:8.1f} us, int4 {timings['int4']:8.1f} us "
            f"({row['int4']['GB/s']:7.1f} GB/s packed, x{row['int4_speedup']}), triton fused "
            f"{timings['fused']:8.1f} us, dequant+mm {timings['dequant_mm']:8.1f} us{cuda}, "
            f"rel_err {err:.1e}",
            flush=True,
        )
    del layouts, weights, fragments
    torch.cuda.empty_cache()
    return rows


def candidates(m: int, n: int, k: int) -> list[int4_tiles.TileConfig]:
    """First pass: kinds and row tiles that fit M (``dot_t`` up to 16 rows), column tiles and
    splits (any count: a split that does not divide K's tiles gives some programs one tile
    more, and can fill the SMs' last wave better), 3 stages, the serial split-K sum."""
    # The fma kind (CUDA cores) lost to the dot kind at every M of the first H200 sweep, with
    # its codes unpacked by Triton ops; with the inline PTX unpack it is swept again up to 4 rows.
    blocks_m = [("dot", 16), ("dot_t", 16)] if m <= 16 else [("dot", 32), ("dot", 64)]
    if m <= 4:
        blocks_m.append(("fma", triton.next_power_of_2(m)))
    widths = ((64, 4), (128, 4), (256, 8)) if m <= 16 else ((64, 4), (128, 4), (256, 4), (256, 8))
    out = []
    k_tiles = triton.cdiv(k, 128)
    for kind, bm in blocks_m:
        for bn, warps in widths:
            programs = triton.cdiv(m, bm) * triton.cdiv(n, bn)
            for split in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32):
                if split > k_tiles or (split > 1 and not 100 <= programs * split <= 8 * 132):
                    continue
                out.append(int4_tiles.TileConfig(kind, bm, bn, 128, split, warps, 3))
    return out


MAX_REL_ERR = 5e-3
"""A candidate whose output is further than this from the float32 reference (relative norm, as
the GPU tests check) is not timed: a sweep must not pick a fast wrong kernel."""


def time_tiles(
    x: torch.Tensor, layouts: list[KernelLayout], cfg: int4_tiles.TileConfig, ref: torch.Tensor
) -> float:
    """The tiles' time, or infinity (and why) when they do not compile or run, or compute
    something else than ``ref`` (`reference_gemm` of ``x`` and the first layout)."""
    calls = [
        functools.partial(
            w4a16.w4a16_gemm, x, lay.qweight, lay.scales, lay.zeros, lay.group_size, tiles=cfg
        )
        for lay in layouts
    ]
    try:
        err = ((calls[0]().float() - ref).norm() / ref.norm()).item()
        if not err < MAX_REL_ERR:
            print(f"  {cfg}: relative error {err:.2e} against the reference, not timed", flush=True)
            return float("inf")
        return graph_us(calls, replays=3)
    except Exception as exc:  # noqa: BLE001 - a candidate that fails is reported and skipped
        print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return float("inf")


def sweep_layer(n: int, k: int, group: int, ms: list[int]) -> dict[str, dict[str, Any]]:
    """The fastest tiles at each of ``ms`` for this matmul (graph-timed, L2 flushed)."""
    layouts = layout_copies(random_layout(n, k, group))
    best: dict[str, dict[str, Any]] = {}
    for m in ms:
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        ref = int4_gemm.reference_gemm(x.float(), layouts[0])

        timed = sorted(
            ((time_tiles(x, layouts, cfg, ref), cfg) for cfg in candidates(m, n, k)),
            key=lambda pair: pair[0],
        )
        us, top = timed[0]
        # Second pass around the winner: warps and pipeline depth.
        variants: list[dict[str, Any]] = [{"num_stages": 4}, {"num_stages": 2}]
        if top.split_k > 1:
            variants.append({"reduce": "kernel"})  # the partial sums in a second launch
        if top.kind == "dot":
            variants.append({"unpack": "shift"})  # Triton ops instead of the inline PTX
            variants.append({"chains": 2})  # two MMA chains a tile
        for change in variants:
            cfg = dataclasses.replace(top, **change)
            t = time_tiles(x, layouts, cfg, ref)
            if t < us:
                us, top = t, cfg
        best[str(m)] = {**int4_tiles.table_entry(top), "us": round(us, 2)}
        print(
            f"sweep N={n} K={k} M={m}: {top} {us:.1f} us (of {len(timed) + len(variants)})",
            flush=True,
        )
    del layouts
    torch.cuda.empty_cache()
    return best


def probe(group: int, ms: list[int], grid: dict[str, list[Any]], out_json: Path | None) -> None:
    """Every tile of a grid (``grid``: kinds, stages, chains) for each matmul at each of
    ``ms``, timed and printed (no table written): how the time moves with the pipeline depth,
    the split, the column tile and the MMA chains."""
    rows = []
    for name, (n, k) in LAYERS.items():
        layouts = layout_copies(random_layout(n, k, group))
        for m in ms:
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            ref = int4_gemm.reference_gemm(x.float(), layouts[0])
            kinds = [kd for kd in grid["kinds"] if kd == "dot" or m <= 16]
            for kind, bn, split, st, ch in itertools.product(
                kinds, (64, 128), (1, 4, 8, 16), grid["stages"], grid["chains"]
            ):
                if split > triton.cdiv(k, 128) or (ch > 1 and kind != "dot"):
                    continue
                # the fma kind (CUDA cores) takes the rows themselves, up to 4 a program
                bm = min(4, triton.next_power_of_2(m)) if kind == "fma" else 16 if m <= 16 else 64
                cfg = int4_tiles.TileConfig(kind, bm, bn, 128, split, 4, st, chains=ch)
                us = time_tiles(x, layouts, cfg, ref)
                rows.append({"layer": name, "M": m, **dataclasses.asdict(cfg), "us": us})
                print(
                    f"probe {name} M={m} {kind} bn={bn} split={split} stages={st} chains={ch}: "
                    f"{us:.2f} us",
                    flush=True,
                )
        del layouts
        torch.cuda.empty_cache()
    if out_json:
        out_json.write_text(json.dumps(rows) + "\n")


def sweep(group: int, sweep_json: Path | None, ms: list[int]) -> None:
    """Each matmul's fastest tiles into the device's table (the entries of other Ms kept),
    written after each matmul."""
    name = torch.cuda.get_device_name()
    path = int4_tiles._device_file(name)
    table = json.loads(path.read_text()) if path.is_file() else {"device": name, "tiles": {}}
    table.setdefault("measured_us", {})
    for n, k in LAYERS.values():
        shape = f"{n},{k},{group}"
        best = sweep_layer(n, k, group, ms)
        table["tiles"].setdefault(shape, {}).update(
            {m: {f: v for f, v in e.items() if f != "us"} for m, e in best.items()}
        )
        table["measured_us"].setdefault(shape, {}).update({m: e["us"] for m, e in best.items()})
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        if sweep_json:
            sweep_json.write_text(path.read_text())
    int4_tiles.measured_table.cache_clear()
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", type=int, nargs="+", default=MS)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--output-json", type=Path)
    parser.add_argument("--sweep", action="store_true", help="measure tiles, write the table")
    parser.add_argument("--sweep-json", type=Path, help="a copy of the table --sweep writes")
    parser.add_argument("--sweep-ms", type=int, nargs="+", default=SWEEP_MS)
    parser.add_argument(
        "--probe", action="store_true", help="time a fixed grid of tiles, print all"
    )
    parser.add_argument(
        "--probe-kinds", nargs="+", default=["dot"], choices=["dot", "dot_t", "fma"]
    )
    parser.add_argument("--probe-stages", type=int, nargs="+", default=[3])
    parser.add_argument("--probe-chains", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    if args.probe:
        grid = {"kinds": args.probe_kinds, "stages": args.probe_stages, "chains": args.probe_chains}
        probe(args.group_size, args.sweep_ms, grid, args.output_json)
        return
    if args.sweep:
        sweep(args.group_size, args.sweep_json, args.sweep_ms)
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
        "cuda_fused_max_m": int4_gemm.CUDA_FUSED_MAX_M,
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
