"""4-bit values in int32 words, as the checkpoint formats pack them: eight nibbles a word, along
the rows (``pack_rows``: GPTQ's ``qweight``, compressed-tensors' zero points) or along the
columns (``pack_cols``: GPTQ's and AWQ's ``qzeros``, AWQ's ``qweight``, compressed-tensors'
``weight_packed``). Nibble ``i`` of a word sits at bits ``4i .. 4i+3`` and holds row/column
``order[i]`` of its group of eight: the natural order, except AWQ's interleaved one.

Values are unsigned (0..15) uint8 tensors; packed words are int32 (bit 31 wraps to the sign, as
the formats store them). A dimension that is not a multiple of 8 is padded with zero nibbles.
"""

from __future__ import annotations

import torch

from pagellm_int4.scheme import BITS, PACK

NATURAL_ORDER = (0, 1, 2, 3, 4, 5, 6, 7)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AutoAWQ's GEMM layout: nibble i of a word holds output column AWQ_ORDER[i] of its eight."""

_MASK = (1 << BITS) - 1


def pack_cols(values: torch.Tensor, order: tuple[int, ...] = NATURAL_ORDER) -> torch.Tensor:
    """[R, C] nibbles -> [R, ceil(C / 8)] int32, eight consecutive columns a word."""
    if values.dim() != 2:
        raise ValueError(f"pack_cols takes a 2-D tensor, got shape {tuple(values.shape)}.")
    rows, cols = values.shape
    pad = -cols % PACK
    v = torch.nn.functional.pad(values.to(torch.int32), (0, pad)) & _MASK
    v = v.reshape(rows, (cols + pad) // PACK, PACK)
    words = torch.zeros(v.shape[:2], dtype=torch.int32, device=values.device)
    # One nibble position at a time (int32 all along: large layers pack on the GPU at load);
    # the top nibble's shift sets bit 31, the sign, as the formats store it.
    for nibble, column in enumerate(order):
        words |= v[:, :, column] << (BITS * nibble)
    return words


def unpack_cols(
    words: torch.Tensor, cols: int, order: tuple[int, ...] = NATURAL_ORDER
) -> torch.Tensor:
    """[R, W] int32 -> [R, cols] uint8 nibbles (the padding dropped)."""
    if words.dtype != torch.int32:
        raise ValueError(f"Packed 4-bit words must be int32, got {words.dtype}.")
    out = torch.empty(*words.shape, PACK, dtype=torch.uint8, device=words.device)
    for nibble, column in enumerate(order):
        out[:, :, column] = ((words >> (BITS * nibble)) & _MASK).to(torch.uint8)
    return out.reshape(words.shape[0], -1)[:, :cols]


def pack_rows(values: torch.Tensor, order: tuple[int, ...] = NATURAL_ORDER) -> torch.Tensor:
    """[R, C] nibbles -> [ceil(R / 8), C] int32, eight consecutive rows a word."""
    return pack_cols(values.t(), order).t().contiguous()


def unpack_rows(
    words: torch.Tensor, rows: int, order: tuple[int, ...] = NATURAL_ORDER
) -> torch.Tensor:
    """[W, C] int32 -> [rows, C] uint8 nibbles."""
    return unpack_cols(words.t(), rows, order).t().contiguous()
