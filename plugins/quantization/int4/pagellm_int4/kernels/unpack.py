"""Turning a tile of int4 words into the codes the W4A16 kernels multiply: eight slabs of a word
tile (nibble i of every word), as float bits rather than through int-to-float conversions (a
quarter-rate instruction), by Triton ops or by inline PTX two words at a time."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Float bit patterns whose low mantissa bits take a 4-bit code exactly: bfloat16 128 + q,
# float16 1024 + q, float32 2^23 + q. The products then carry ``offset * sum(x)``, taken off
# once per tile with the zero point; float32 (the interpreter's) subtracts 2^23 at once instead.
CODE_FP32: tl.constexpr = tl.constexpr(0)
CODE_BF16: tl.constexpr = tl.constexpr(1)
CODE_FP16: tl.constexpr = tl.constexpr(2)
CODE_OF = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
CODE_OFFSET = {0: 0.0, 1: 128.0, 2: 1024.0}

# Two words and the tile's zero points in, eight registers out, each holding slab i of both
# words as a 16-bit pair q - z: the low halves of the two words (nibbles 0-3) and the high
# halves (4-7) are put side by side with PRMT; (h >> 4j) & 0x000F000F | MAGIC (one LOP3, 0xEA:
# (a & b) | c) is the pair offset + q; one packed FMA, t * 1 + (-(offset + z)), leaves q - z,
# exact (small integers). The dot then needs no correction, hence no sum of the activations.
_UNPACK_PTX = """{
.reg .b32 lo, hi, t, one;
mov.b32 one, ONE;
prmt.b32 lo, $8, $9, 0x5410;
prmt.b32 hi, $8, $9, 0x7632;
lop3.b32 t, lo, 0x000f000f, MAGIC, 0xea;
fma.rn.TYPE $0, t, one, $10;
shr.u32 t, lo, 4;
lop3.b32 t, t, 0x000f000f, MAGIC, 0xea;
fma.rn.TYPE $1, t, one, $10;
shr.u32 t, lo, 8;
lop3.b32 t, t, 0x000f000f, MAGIC, 0xea;
fma.rn.TYPE $2, t, one, $10;
shr.u32 t, lo, 12;
lop3.b32 t, t, 0x000f000f, MAGIC, 0xea;
fma.rn.TYPE $3, t, one, $10;
lop3.b32 t, hi, 0x000f000f, MAGIC, 0xea;
fma.rn.TYPE $4, t, one, $10;
shr.u32 t, hi, 4;
lop3.b32 t, t, 0x000f000f, MAGIC, 0xea;
fma.rn.TYPE $5, t, one, $10;
shr.u32 t, hi, 8;
lop3.b32 t, t, 0x000f000f, MAGIC, 0xea;
fma.rn.TYPE $6, t, one, $10;
shr.u32 t, hi, 12;
lop3.b32 t, t, 0x000f000f, MAGIC, 0xea;
fma.rn.TYPE $7, t, one, $10;
}"""
_UNPACK_BF16: tl.constexpr = tl.constexpr(
    _UNPACK_PTX.replace("MAGIC", "0x43004300")
    .replace("TYPE", "bf16x2")
    .replace("ONE", "0x3f803f80")
)
_UNPACK_FP16: tl.constexpr = tl.constexpr(
    _UNPACK_PTX.replace("MAGIC", "0x64006400").replace("TYPE", "f16x2").replace("ONE", "0x3c003c00")
)
_SLAB_CONSTRAINTS: tl.constexpr = tl.constexpr("=r,=r,=r,=r,=r,=r,=r,=r,r,r,r")


@triton.jit
def unpack_slabs(words, neg_zero, CODE: tl.constexpr):
    """The eight slabs of ``words`` as q - z, in bfloat16 (CODE_BF16) or float16; ``neg_zero``
    is -(offset + z) in that dtype, broadcast to the words' shape."""
    if CODE == CODE_BF16:
        return tl.inline_asm_elementwise(
            _UNPACK_BF16,
            _SLAB_CONSTRAINTS,
            [words, neg_zero],
            (tl.bfloat16,) * 8,
            is_pure=True,
            pack=2,
        )
    else:
        return tl.inline_asm_elementwise(
            _UNPACK_FP16,
            _SLAB_CONSTRAINTS,
            [words, neg_zero],
            (tl.float16,) * 8,
            is_pure=True,
            pack=2,
        )


@triton.jit
def slab_codes(words, i: tl.constexpr, CODE: tl.constexpr):
    """Slab ``i`` of ``words`` as offset + code in the activations' dtype (Triton ops)."""
    nib = (words >> (4 * i)) & 0xF
    if CODE == CODE_BF16:
        return (nib | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif CODE == CODE_FP16:
        return (nib | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        return (nib | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def codes_f32(words, i: tl.constexpr):
    """Slab ``i`` of ``words`` as float32 codes (2^23 + q, less 2^23: exact, no conversion)."""
    return (((words >> (4 * i)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
