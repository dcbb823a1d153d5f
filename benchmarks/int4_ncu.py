"""One int4 W4A16 matmul of a Llama-3.1-8B layer, run a few times, for Nsight Compute to profile
(where the fused kernel's warps stall, how busy its pipes and memory are):

    ncu --kernel-name regex:w4a16 --launch-skip 3 --launch-count 1 --set full \\
        python3 benchmarks/int4_ncu.py --layer o --m 1

The kernel runs with the tiles the package's table (or rule) gives for that shape. Nsight Compute
flushes the caches before the profiled launch (its default cache control), so it reads memory.
"""

from __future__ import annotations

import argparse

import torch
from int4_gemm import LAYERS, random_layout
from pagellm_int4.kernels import w4a16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer", choices=sorted(LAYERS), default="o")
    parser.add_argument("--m", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--launches", type=int, default=6)
    args = parser.parse_args()
    n, k = LAYERS[args.layer]
    w = random_layout(n, k, args.group_size)
    x = torch.randn(args.m, k, dtype=torch.bfloat16, device="cuda")
    for _ in range(args.launches):
        w4a16.w4a16_gemm(x, w.qweight, w.scales, w.zeros, w.group_size)
    torch.cuda.synchronize()
    print(f"{args.layer} M={args.m}: {args.launches} launches of the fused W4A16 kernel")


if __name__ == "__main__":
    main()
