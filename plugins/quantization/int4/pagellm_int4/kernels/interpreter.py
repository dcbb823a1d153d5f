"""Triton's interpreter (``TRITON_INTERPRET=1``, the CPU tests) before 3.7 holds every scalar as a
one-element array and turns a loop bound into an int with ``int(array)``, which NumPy >= 2.4
refuses. The GEMM's split-K loop has runtime bounds: `allow_runtime_loop_bounds` converts through
``.item()`` instead, only when the interpreter is on and NumPy refuses."""

from __future__ import annotations

from typing import Any

import numpy as np


def allow_runtime_loop_bounds() -> None:
    try:
        int(np.zeros(1, dtype=np.int32))
        return
    except TypeError:
        pass
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "index_via_item", False):
        return  # installed already (here, or by another package's same fix)

    def patch(tensor: Any, *scope: Any) -> None:
        original(tensor, *scope)
        as_int = lambda self: int(self.handle.data.item())  # noqa: E731
        if scope:  # Triton >= 3.7 undoes its patches after each launch through this scope
            scope[0].set_attr(tensor, "__index__", as_int)
        else:
            tensor.__index__ = as_int

    patch.index_via_item = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch
