"""Fixes for three bugs of Triton's interpreter (``TRITON_INTERPRET=1``), which runs these kernels
on CPU for the tests.

1. Loops with runtime bounds (Triton < 3.7): the interpreter holds every scalar as a one-element
   array and converts it with ``int(array)``, which NumPy >= 2.4 refuses (``TypeError``).
2. ``tl.dot`` on bfloat16 (every release from 3.2 to 3.9): the interpreter stores bfloat16 as raw
   ``uint16`` bits and multiplies the bits, not the numbers.
3. Rounding to float8_e4m3fn (every release from 3.2 to 3.9): the interpreter rounds ties away
   from zero instead of to even, and a mantissa that rounds up past its top does not carry into
   the exponent (126.0 becomes 64.0 instead of 128.0). The fix rounds with torch, which rounds
   as the GPU does (to nearest-even). Reading float8 back (upcasts) is right and left alone.

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


_E4M3_128 = 0x70
"""128.0 in float8_e4m3fn: sign 0, exponent 7 + 7 = 0b1110, mantissa 0."""


def _fp8_rounding_is_broken(interpreter: Any) -> bool:
    import triton.language as tl

    x = interpreter.TensorHandle(np.array([126.0], dtype=np.float32), tl.float32)
    rtne = interpreter._ir.ROUNDING_MODE.RTNE
    out = interpreter.InterpreterBuilder.create_fp_to_fp(None, x, tl.float8e4nv, rtne)
    return int(out.data.reshape(-1)[0]) != _E4M3_128


def _round_to_e4m3(handle: Any, interpreter: Any) -> Any:
    import torch
    import triton.language as tl

    data = handle.data
    if handle.dtype.scalar == tl.bfloat16:
        data = _bf16_bits_to_f32(data)
    f32 = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
    bits = f32.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    return interpreter.TensorHandle(bits.reshape(handle.data.shape), tl.float8e4nv)


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

    if _fp8_rounding_is_broken(interpreter):
        create_fp_to_fp = interpreter.InterpreterBuilder.create_fp_to_fp
        rtne = interpreter._ir.ROUNDING_MODE.RTNE
        sources = (tl.float32, tl.float16, tl.bfloat16)

        def patched_fp_to_fp(self: Any, src: Any, dst_type: Any, rounding_mode: Any) -> Any:
            if (
                dst_type.scalar == tl.float8e4nv
                and src.dtype.scalar in sources
                and rounding_mode == rtne
            ):
                return _round_to_e4m3(src, interpreter)
            return create_fp_to_fp(self, src, dst_type, rounding_mode)

        interpreter.InterpreterBuilder.create_fp_to_fp = patched_fp_to_fp
