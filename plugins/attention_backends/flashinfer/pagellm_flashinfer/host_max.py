"""The longest row of a plan in one tensor op, not a Python loop over the rows.

FlashInfer 0.6's wrappers take the longest KV length of a step in ``plan`` with Python's
``max()`` over a host tensor of the rows' lengths (``max(kv_lens_arr_host).item()``), and the
built-in walks a tensor element by element, making a 0-d tensor per row: 1.0 ms at 256 rows,
0.27 ms at 64 on the development machine's CPU, host time in every step with a multi-token row
(its prefill wrapper is planned each such step). An H100 step profile of W2-like prefill steps
(`benchmarks/step_profile.py`, which waits for each step, so host time shows) put FLASHINFER's
step 0.8 ms longer than TRITON_ATTN's with fewer kernel milliseconds.

`shadow_max` gives the wrappers' modules a module-level ``max`` (found before the built-in)
that returns a non-empty 1-D tensor's maximum with ``Tensor.max()`` (the same value, a 0-d
tensor as before) and is the built-in for every other call.
"""

from __future__ import annotations

import builtins
import importlib
import logging
from types import ModuleType
from typing import Any

import torch

logger = logging.getLogger(__name__)

PLANNING_MODULES = ("prefill", "decode")
"""FlashInfer's modules whose wrappers' ``plan`` take the longest row with ``max()``."""


def tensor_max(*args: Any, **kwargs: Any) -> Any:
    """The built-in ``max``, except for a lone non-empty 1-D tensor: its ``Tensor.max()``."""
    if len(args) == 1 and not kwargs:
        (values,) = args
        if isinstance(values, torch.Tensor) and values.dim() == 1 and values.numel() > 0:
            return values.max()
    return builtins.max(*args, **kwargs)


def shadow_max(flashinfer: ModuleType) -> list[str]:
    """Puts `tensor_max` as ``max`` in FlashInfer's planning modules; returns their names."""
    shadowed = []
    for name in PLANNING_MODULES:
        try:
            module = importlib.import_module(f"{flashinfer.__name__}.{name}")
        except ImportError:
            continue
        module.max = tensor_max  # type: ignore[attr-defined]
        shadowed.append(module.__name__)
    logger.debug("max() of a 1-D tensor in one op in %s", ", ".join(shadowed) or "no module")
    return shadowed
