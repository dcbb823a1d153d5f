"""The launch shapes of pagellm-int4's CUDA W4A16 GEMM (warps a block, blocks a strip, steps of
weights and of x loaded ahead) for each matmul of one Llama-3.1-8B layer at each M of ``--sweep-ms``, graph-timed
with L2-cold weight copies as ``int4_gemm.py`` times, each checked against the float32 reference
first; the shape `cuda.kernels.default_config` picks is marked. Prints the best and the default
per matmul and M, and writes every timing to ``--output-json``.

    python benchmarks/int4_cuda_sweep.py [--sweep-ms 1 16] [--group-size 128] [--rings d8 d8x2 d8p16 d8x2p16]
        [--output-json F]

The JSON is written again after each matmul, so a run cut short keeps what it timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
from pathlib import Path

import torch
from int4_gemm import (
    DEVICE,
    LAYERS,
    MAX_REL_ERR,
    cuda_kernels,
    fragment_copies,
    graph_us,
    int4_gemm,
    packed_bytes,
    random_values,
)
from pagellm_int4.cuda.kernels import (
    PREFETCH_DISTANCES,
    X_DEPTHS,
    MmaConfig,
    default_config,
    scaling_steps,
)
from pagellm_int4.fragment_layout import to_fragment_layout
from pagellm_int4.kernel_layout import to_kernel_layout


def ring(name: str) -> tuple[int, int, int]:
    """``d8`` -> (8, 8, 0), ``d8x2`` -> (8, 2, 0), ``d8x2p16`` -> (8, 2, 16): steps of weights
    and of x loaded ahead, and the L2 prefetch distance (0: none)."""
    head, _, prefetch = name.removeprefix("d").partition("p")
    depth, _, x_depth = head.partition("x")
    return int(depth), int(x_depth or depth), int(prefetch or 0)


def cuda_sweep(
    group: int,
    ms: list[int],
    rings: list[str],
    out_json: Path | None,
    warps_choices: tuple[int, ...] = (4, 8, 16),
    splits_choices: tuple[int, ...] = (1, 2, 3, 4, 6, 8),
) -> None:
    """The CUDA GEMM's launch shapes for each matmul at each of ``ms`` (graph-timed, L2
    flushed), each checked against the reference first; the default shape marked."""
    for name in rings:
        depth, x_depth, prefetch = ring(name)
        if x_depth not in X_DEPTHS.get(depth, ()) or prefetch not in PREFETCH_DISTANCES[depth]:
            raise SystemExit(f"no kernel for ring {name}: {X_DEPTHS}, {PREFETCH_DISTANCES}")
    kernels = cuda_kernels()
    if kernels is None:
        raise SystemExit("the sweep needs the CUDA kernels")
    rows = []
    for name, (n, k) in LAYERS.items():
        values = random_values(n, k, group)
        layout = to_kernel_layout(values, group, "bench")
        fragments = fragment_copies(to_fragment_layout(values, group, "bench"))
        for m in ms:
            default = default_config(fragments[0].n64, fragments[0].k16, kernels.num_sms, m)
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            ref = int4_gemm.reference_gemm(x.float(), layout)
            timed = []
            spg = scaling_steps(fragments[0].steps_per_group)
            shapes = itertools.product(warps_choices, splits_choices, map(ring, rings))
            for warps, splits, (depth, x_depth, prefetch) in shapes:
                cfg = MmaConfig(
                    warps, splits, depth, None if x_depth == depth else x_depth, prefetch
                )
                if cfg.kernel_problem(min(m, 16), spg) or cfg.steps(fragments[0].k16) < 2:
                    continue
                out = kernels.gemm(x, fragments[0], cfg)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                if not err < MAX_REL_ERR:
                    print(f"  {cfg}: relative error {err:.2e}, not timed", flush=True)
                    continue
                us = graph_us([functools.partial(kernels.gemm, x, f, cfg) for f in fragments], 3)
                timed.append((us, cfg))
                rows.append(
                    {
                        "layer": name,
                        "M": m,
                        **dataclasses.asdict(cfg),
                        "us": round(us, 2),
                        "default": cfg == default,
                    }
                )
            timed.sort(key=lambda pair: pair[0])
            default_us = (
                next(us for us, cfg in timed if cfg == default)
                if any(cfg == default for _, cfg in timed)
                else float("nan")
            )
            print(
                f"cuda sweep {name} M={m}: best {timed[0][1]} {timed[0][0]:.2f} us; default "
                f"{default} {default_us:.2f} us; packed GB/s at best "
                f"{packed_bytes(fragments[0]) / timed[0][0] / 1e3:.0f}",
                flush=True,
            )
        del fragments
        torch.cuda.empty_cache()
        if out_json:
            out_json.write_text(json.dumps(rows) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep-ms", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument(
        "--rings",
        nargs="+",
        default=["d8", "d8x2", "d8p16", "d8x2p16"],
        help="steps of weights and x loaded ahead and the L2 prefetch: d4, d8, d8x2 (x 2 steps "
        "ahead), d8p16 and d8x2p16 (each step prefetches the tile 16 steps ahead into L2)",
    )
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    cuda_sweep(
        args.group_size,
        args.sweep_ms,
        args.rings,
        args.output_json,
        tuple(args.warps),
        tuple(args.splits),
    )


if __name__ == "__main__":
    main()
