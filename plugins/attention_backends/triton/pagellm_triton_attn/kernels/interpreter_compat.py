"""Fixes for two bugs of Triton's interpreter (``TRITON_INTERPRET=1``), which runs these kernels
on CPU for the tests.

1. Loops with runtime bounds (Triton < 3.7): the interpreter holds every scalar as a one-element
   array and converts it with ``int(array)``, which NumPy >= 2.4 refuses (``TypeError``).
2. ``tl.dot`` on bfloat16 (every release from 3.2 to 3.9): the interpreter stores bfloat16 as raw
   ``uint16`` bits and multiplies the bits, not the numbers.

Each fix is installed only when the interpreter is on (the caller checks) and a probe shows the
bug, so compiled (GPU) kernels and fixed Triton versions are left alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _index_conversion_is_broken() -> bool:
    try:
        int(np.ones(1, dtype=np.int32))
    except TypeError:
        return True
    return False


def _bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    # bfloat16 is the upper half of a float32.
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _bf16_dot_is_broken(interpreter: Any) -> bool:
    import triton.language as tl

    one = interpreter.TensorHandle(np.full((1, 1), 0x3F80, dtype=np.uint16), tl.bfloat16)
    acc = interpreter.TensorHandle(np.zeros((1, 1), dtype=np.float32), tl.float32)
    product = interpreter.InterpreterBuilder.create_dot(None, one, one, acc, "tf32", 0)
    return float(product.data[0, 0]) != 1.0


def install_interpreter_fixes() -> None:
    """Idempotent, also across re-imports of this package (the fixes mark what they replace)."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang_tensor = interpreter._patch_lang_tensor
    if _index_conversion_is_broken() and not hasattr(patch_lang_tensor, "pagellm_fix"):

        def patched_lang_tensor(tensor: Any, *scope: Any) -> None:
            # Triton >= 3.7 passes a scope that undoes the patches after each launch.
            patch_lang_tensor(tensor, *scope)
            index = lambda self: int(self.handle.data.item())  # noqa: E731
            if scope:
                scope[0].set_attr(tensor, "__index__", index)
            else:
                tensor.__index__ = index

        patched_lang_tensor.pagellm_fix = True  # type: ignore[attr-defined]
        interpreter._patch_lang_tensor = patched_lang_tensor

    if _bf16_dot_is_broken(interpreter):
        create_dot = interpreter.InterpreterBuilder.create_dot

        def as_f32(handle: Any) -> Any:
            if handle.dtype.scalar == tl.bfloat16:
                return interpreter.TensorHandle(_bf16_bits_to_f32(handle.data), tl.float32)
            return handle

        def patched_dot(self: Any, a: Any, b: Any, acc: Any, *args: Any) -> Any:
            return create_dot(self, as_f32(a), as_f32(b), acc, *args)

        interpreter.InterpreterBuilder.create_dot = patched_dot
