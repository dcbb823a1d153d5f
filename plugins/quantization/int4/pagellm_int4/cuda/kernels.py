"""The CUDA W4A16 kernels over the fragment layout: `CudaKernels.gemm` (M <= 16 a launch, on the
tensor cores, weights streamed once) and `CudaKernels.dequantize_t` (W^T in the activations'
dtype for a cuBLAS GEMM), and the launch shape of the GEMM (`MmaConfig`)."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass

import torch

from pagellm_int4.cuda.build import build_cubin
from pagellm_int4.cuda.driver import Launch, Module, can_overlap
from pagellm_int4.fragment_layout import FragmentLayout

logger = logging.getLogger(__name__)

ROWS_PER_LAUNCH = 16
"""Rows of x one GEMM launch takes (two MMAs of 8): larger M runs in launches of 16 rows."""
PDL_ENV = "PAGELLM_INT4_PDL"
"""``1``: launch the GEMM with programmatic dependent launch on sm_90+ (its first weight loads
overlap the end of the kernel before it); ``0`` (the default until it is timed on a GPU)."""
X_DEPTHS = {4: (4,), 8: (8, 2)}
"""Steps of x loaded ahead that the kernels have for each depth of the weights' ring."""
PREFETCH_DISTANCES = {4: (0,), 8: (0, 16)}
"""L2 prefetch distances (steps ahead; 0: none in the loop) the kernels have for each depth."""
_DTYPE_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class MmaConfig:
    warps: int
    """Warps a block: one 64-column strip, consecutive runs of K, summed in shared memory."""
    splits: int
    """Blocks a strip: their float32 partial sums are added, in split order, by the last."""
    depth: int = 4
    """16-row steps of weights a warp loads ahead (registers)."""
    x_depth: int | None = None
    """Steps of x loaded ahead (x is read by every strip, mostly from L1 or L2): ``None`` is
    ``depth``; 2 (with depth 8) saves registers, 45 a thread at 16 rows (173 to 128 on sm_90)."""
    prefetch: int = 0
    """With depth 8: each step also prefetches into L2 the tile this many steps ahead (16), so
    more weight bytes are in flight than the ring's registers hold; 0: none."""

    @property
    def x_steps(self) -> int:
        """Steps of x loaded ahead (``x_depth``, else ``depth``)."""
        return self.x_depth or self.depth

    def kernel_problem(self, rows: int, spg: int) -> str | None:
        """Why the compiled kernels have no such launch for 8 (``rows`` <= 8) or 16 rows and
        ``spg`` steps a scaling, or None."""
        x_depth = self.x_steps
        if self.depth not in X_DEPTHS or x_depth not in X_DEPTHS[self.depth]:
            return f"no kernel loads weights {self.depth} and x {x_depth} steps ahead"
        if self.prefetch not in PREFETCH_DISTANCES[self.depth]:
            return f"no kernel with depth {self.depth} prefetches {self.prefetch} steps ahead"
        if (x_depth != self.depth or self.prefetch) and spg < 4:
            return (
                f"x {x_depth} steps ahead or an L2 prefetch needs 4 or 8 steps a scaling, not {spg}"
            )
        max_warps = 16 if rows <= 8 and spg >= 4 else 8
        if not 1 <= self.warps <= max_warps:
            return f"{self.warps} warps a block: at most {max_warps} here"
        return None

    def kernel_name(self, dtype: str, rows: int, spg: int) -> str:
        ring = f"d{self.depth}" + (f"x{self.x_steps}" if self.x_steps != self.depth else "")
        ring += f"p{self.prefetch}" if self.prefetch else ""
        return f"w4a16_mma_{dtype}_m{8 if rows <= 8 else 16}_{ring}_s{spg}"

    def steps(self, k16: int, unroll: int = 1) -> int:
        """16-row steps a warp: K shared by warps x splits, rounded up to ``unroll``."""
        chunks = self.warps * self.splits
        per = -(-k16 // chunks)
        return -(-per // unroll) * unroll


def scaling_steps(steps_per_group: int) -> int:
    """Steps between two scalings of the kernel's sums (its SPG): the largest of 8, 4, 2, 1
    dividing the group's steps."""
    for spg in (8, 4, 2):
        if steps_per_group % spg == 0:
            return spg
    return 1


RULE_ENV = "PAGELLM_INT4_LAUNCH_RULE"
"""The GEMM's launch-shape rule: ``measured`` (the default), or a candidate to time against it
in a whole model (`RULES`)."""
RULES = ("measured", "x2", "x2p16")


def default_config(
    n64: int, k16: int, num_sms: int, m: int = 1, spg: int = 8, rule: str = "measured"
) -> MmaConfig:
    """``measured``: eight steps loaded ahead; for M <= 8, blocks of 4 warps and K split until
    about 16 warps an SM, each with at least one pass of 8 steps; for 9..16 rows (twice the
    MMAs, partial sums twice as large) half as many warps, in blocks of 8 unless N is wide. On an
    H100 this is the fastest launch shape of ``benchmarks/int4_cuda_sweep.py`` for six of the
    eight Llama-3.1-8B matmuls at M = 1 and 16, and within 14 % of it for the other two
    (docs/benchmarks.md, 2026-12-08).

    Candidates, not yet timed (``spg``, the steps a scaling, must be 4 or 8 for them, else they
    are ``measured``): ``x2``: at 9..16 rows, x two steps ahead (128 registers instead of 173, so
    as many warps an SM as at 8 rows) and the 8-row warps and splits; ``x2p16``: that, and at
    every M each step prefetching into L2 the tile 16 steps ahead."""
    if rule not in RULES:
        raise ValueError(f"{RULE_ENV}={rule!r}: expected one of {', '.join(RULES)}")
    depth = 8
    candidate = rule != "measured" and spg >= 4
    if m <= 8 or candidate:
        warps, target = 4, 16 * num_sms
    else:
        warps, target = (4 if n64 >= 256 else 8), 8 * num_sms
    splits = 1
    while n64 * warps * splits * 2 <= target and k16 >= warps * splits * 2 * 8:
        splits *= 2
    if not candidate:
        return MmaConfig(warps, splits, depth)
    return MmaConfig(warps, splits, depth, 2 if m > 8 else None, 16 if rule == "x2p16" else 0)


class CudaKernels:
    """The compiled kernels on one device (`for_device`)."""

    def __init__(self, device: torch.device) -> None:
        major, minor = torch.cuda.get_device_capability(device)
        self.arch = f"sm_{major}{minor}"
        cubin, self.compile_seconds = build_cubin(self.arch)
        self.module = Module(cubin, device)
        self.device = device
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.rule = os.environ.get(RULE_ENV, "measured")
        if self.rule not in RULES:  # said at start-up, not at the first GEMM
            raise ValueError(f"{RULE_ENV}={self.rule!r}: expected one of {', '.join(RULES)}")
        if self.rule != "measured":
            logger.info("int4 CUDA GEMMs: launch-shape rule %r (%s)", self.rule, RULE_ENV)
        self.overlap = os.environ.get(PDL_ENV, "0") == "1"
        """GEMMs launched with programmatic dependent launch (`PDL_ENV`, sm_90+)."""
        if self.overlap and (major < 9 or not can_overlap()):
            logger.info(
                "int4 CUDA GEMMs: %s=1 ignored (programmatic dependent launch needs sm_90 and a "
                "CUDA 12 driver; this is %s)",
                PDL_ENV,
                self.arch,
            )
            self.overlap = False
        elif self.overlap:
            logger.info("int4 CUDA GEMMs launch with programmatic dependent launch (%s=1)", PDL_ENV)
        self._counters = torch.zeros(0, dtype=torch.int32, device=device)

    def reserve_counters(self, strips: int) -> None:
        """Split-K's arrival counters, one a strip, zero between launches; made before any graph
        is captured (a layer's processing calls this)."""
        if self._counters.numel() < strips:
            self._counters = torch.zeros(strips, dtype=torch.int32, device=self.device)

    def gemm(
        self, x: torch.Tensor, layout: FragmentLayout, config: MmaConfig | None = None
    ) -> torch.Tensor:
        """x [M, K] (bf16 or fp16, rows contiguous) times the layer's int4 weight: [M, N]."""
        m, k = x.shape
        n = layout.out_features
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        if m == 0:
            return out
        if x.stride(1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:
            x = x.contiguous()
        spg = scaling_steps(layout.steps_per_group)
        cfg = config or default_config(
            layout.n64, layout.k16, self.num_sms, min(m, ROWS_PER_LAUNCH), spg, self.rule
        )
        steps = cfg.steps(layout.k16, max(cfg.depth, spg))
        splits = -(-layout.k16 // (steps * cfg.warps))  # no block without steps
        dtype = _DTYPE_NAME[x.dtype]
        self.reserve_counters(layout.n64)
        for m0 in range(0, m, ROWS_PER_LAUNCH):
            rows = min(ROWS_PER_LAUNCH, m - m0)
            reduce_rows = 8 if rows <= 8 else 16
            xs, outs = x[m0 : m0 + rows], out[m0 : m0 + rows]
            ws = (
                torch.empty(splits, rows, n, dtype=torch.float32, device=x.device)
                if splits > 1
                else outs
            )
            # The kernel and the arguments that stay (the layer's tensors, the shapes), checked
            # and kept on the layout at the first launch of this shape.
            key = (rows, x.stride(0), cfg, self._counters.data_ptr(), dtype)
            cached = layout.launches.get(key)
            if cached is None:
                problem = cfg.kernel_problem(rows, spg)
                if problem is not None:
                    raise ValueError(f"launch shape {cfg}: {problem}")
                cached = layout.launches[key] = (
                    cfg.kernel_name(dtype, rows, spg),
                    Launch(
                        [
                            ctypes.c_void_p(0),  # x
                            ctypes.c_void_p(layout.words.data_ptr()),
                            ctypes.c_void_p(layout.scales.data_ptr()),
                            ctypes.c_void_p(layout.zeros.data_ptr()),
                            ctypes.c_void_p(0),  # out
                            ctypes.c_void_p(0),  # ws
                            ctypes.c_void_p(self._counters.data_ptr()),
                            ctypes.c_int(rows),
                            ctypes.c_int(n),
                            ctypes.c_int(k),
                            ctypes.c_int(x.stride(0)),
                            ctypes.c_int(layout.k16),
                            ctypes.c_int(layout.steps_per_group),
                            ctypes.c_int(layout.scales.shape[0]),
                            ctypes.c_int(steps),
                            ctypes.c_int(splits),
                        ]
                    ),
                )
            name, launch = cached
            launch.args[0].value = xs.data_ptr()
            launch.args[4].value = outs.data_ptr()
            launch.args[5].value = ws.data_ptr()
            shared = cfg.warps * reduce_rows * 64 * 4
            self.module.launch(
                name, (layout.n64, splits, 1), 32 * cfg.warps, shared, launch, self.overlap
            )
        return out

    def dequantize_t(
        self, layout: FragmentLayout, dtype: torch.dtype, staged: bool = False
    ) -> torch.Tensor:
        """The weight transposed, [N, K] in ``dtype``: (q - z) * s in float32, one rounding.
        ``staged``: through shared memory, stored in whole 16-byte pieces of each row (not yet
        timed on a GPU, so not the default: `benchmarks/int4_gemm.py` times both)."""
        n, k = layout.out_features, layout.in_features
        out = torch.empty(n, k, dtype=dtype, device=layout.words.device)
        warps = 8
        args = [
            ctypes.c_void_p(layout.words.data_ptr()),
            ctypes.c_void_p(layout.scales.data_ptr()),
            ctypes.c_void_p(layout.zeros.data_ptr()),
            ctypes.c_void_p(out.data_ptr()),
            ctypes.c_int(n),
            ctypes.c_int(k),
            ctypes.c_int(layout.k16),
            ctypes.c_int(layout.steps_per_group),
        ]
        grid = (layout.n64, -(-layout.k16 // warps), 1)
        name = f"dequantize_t_{'staged_' if staged else ''}{_DTYPE_NAME[dtype]}"
        self.module.launch(name, grid, 32 * warps, 0, args)
        return out


@functools.cache
def for_device(device: torch.device) -> CudaKernels:
    """The kernels on ``device``, compiled (or found in the cache) and loaded once a process.
    Raises `pagellm_int4.cuda.build.BuildError` or `pagellm_int4.cuda.driver.DriverError`."""
    return CudaKernels(device)
