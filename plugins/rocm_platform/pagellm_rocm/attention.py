"""The ROCm platform's attention backend ranking, with the reason each candidate left out is out.

``TRITON_ATTN`` comes first: its kernels compile for every AMD architecture through Triton's AMD
backend (checked for gfx942, gfx950 and gfx1100 by this package's tests). FlashAttention's ROCm
build (``flash_attn`` with its Composable Kernel or Triton kernels) and AITER (AMD's kernel
library, ``aiter``) are ranked after it only when they import: ``FLASH_ATTN`` is the backend of
``pagellm-flash-attn``; ``ROCM_AITER_FA`` is the name an AITER backend package registers under
(pagellm ships none yet). ``TORCH_SDPA``, the reference, is last. The core's selector also tries
installed backends the ranking does not name, after these.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from importlib.machinery import ModuleSpec

FindSpec = Callable[[str], "ModuleSpec | None"]

# (backend name, the module it needs, why it is left out when that does not import)
_OPTIONAL = (
    (
        "FLASH_ATTN",
        "flash_attn",
        "flash_attn is not installed (FlashAttention's ROCm build: pip install flash-attn from "
        "ROCm's FlashAttention fork, or build it with FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE)",
    ),
    (
        "ROCM_AITER_FA",
        "aiter",
        "aiter (AMD's AITER kernel library) is not installed, and pagellm ships no AITER backend "
        "package yet",
    ),
)


def _find_spec(name: str) -> ModuleSpec | None:
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def attention_ranking(find_spec: FindSpec = _find_spec) -> tuple[list[str], dict[str, str]]:
    """(ranking best first, {backend left out: why}). ``find_spec`` answers whether a module
    imports without importing it (``importlib.util.find_spec``)."""
    ranking = ["TRITON_ATTN"]
    left_out = {}
    for name, module, reason in _OPTIONAL:
        if find_spec(module) is None:
            left_out[name] = reason
        else:
            ranking.append(name)
    ranking.append("TORCH_SDPA")
    return ranking, left_out
