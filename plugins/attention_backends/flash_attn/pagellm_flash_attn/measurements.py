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
_RUN = "H200, 2026-12-01, benchmarks/flash_attn_kernels.py (FA3 from vLLM 0.25.1's bundle)"

MEASUREMENTS: tuple[Measurement, ...] = (
    Measurement("FA4", "prefill", H200, 16, 559.0, _RUN),
    Measurement("FA3", "prefill", H200, 16, 557.0, _RUN),
    Measurement("FA4", "prefill", H200, 128, 617.0, _RUN),
    Measurement("FA3", "prefill", H200, 128, 598.0, _RUN),
    Measurement("TRITON", "decode", H200, 16, 4233.0, _RUN),
    Measurement("FA3", "decode", H200, 16, 3851.0, _RUN),
    Measurement("FA4", "decode", H200, 16, 2875.0, _RUN),
    Measurement("TRITON", "decode", H200, 128, 4260.0, _RUN),
    Measurement("FA3", "decode", H200, 128, 3892.0, _RUN),
    Measurement("FA4", "decode", H200, 128, 3139.0, _RUN),
)
