"""Measured speeds of the kernels per phase, from which `phases` picks one kernel per phase.

Prefill: TFLOP/s of causal attention (a single 8,192-token prompt, head 128, bf16, unless the
source says otherwise). Decode: GB/s of K and V read (256 rows of 1k context, 16 query / 8 KV
heads of 128, bf16, unless the source says otherwise). ``block_size`` None: the source did not
record the page size; such an entry stands for any block size without one of its own.
`benchmarks/flash_attn_kernels.py` measures every importable kernel on a GPU and prints its
results as entries of this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Phase = Literal["prefill", "decode"]


@dataclass(frozen=True)
class Measurement:
    kernel: str
    phase: Phase
    capability: tuple[int, int]
    block_size: int | None
    value: float
    source: str


H200 = (9, 0)

MEASUREMENTS: tuple[Measurement, ...] = (
    Measurement("FA4", "prefill", H200, None, 607.0, "H200, issue 14: 4 x 4,096 tokens"),
    Measurement("FA3", "prefill", H200, None, 595.0, "H200, issue 14: vLLM 0.25.1's FA3"),
    Measurement("FA4", "decode", H200, 16, 3400.0, "H200, issue 14: 128 rows x 2k context"),
    Measurement("FA4", "decode", H200, 128, 3800.0, "H200, issue 14: 128 rows x 2k context"),
    Measurement("FA3", "decode", H200, None, 4000.0, "H200, issue 14: vLLM 0.25.1's FA3"),
    Measurement(
        "TRITON",
        "decode",
        H200,
        16,
        4135.0,
        "H200, docs/benchmarks.md: over TRITON_ATTN's own KV layout, not this backend's",
    ),
)
