"""Triton's interpreter as the GPU's stand-in in CPU tests of Triton kernels.

The interpreter (Triton 3.x) truncates float32 -> bfloat16 casts where NVIDIA GPUs round to
nearest even (``cvt.rn.bf16.f32``); `gpu_bfloat16_rounding` gives it the GPU's rounding for as
long as it is entered, so a kernel that rounds to bf16 the way torch does can be checked bit for
bit against torch."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch


@contextmanager
def gpu_bfloat16_rounding() -> Iterator[None]:
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    truncating = interpreter._convert_float

    def convert(data: np.ndarray, src: Any, dst: Any, rounding: Any) -> np.ndarray:
        if src == tl.float32 and dst == tl.bfloat16:
            f32 = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
            return f32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return truncating(data, src, dst, rounding)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter, "_convert_float", convert)
        yield
