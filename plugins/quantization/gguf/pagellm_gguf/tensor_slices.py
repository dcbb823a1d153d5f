"""`GGUFTensor`: one tensor of a GGUF file under its HF layout, read only when indexed (the core's
`TensorSlice`), so that a tensor-parallel rank reads and dequantizes only its part of the
memory-mapped file.

``t[a:b]`` takes output rows ``a..b`` and ``t[:, a:b]`` input columns: of the float weight (a
column range is dequantized from the blocks covering it), or, for raw blocks (``gguf_type`` set:
the ``gguf`` method keeps them quantized), of the bytes of each row, which the method cuts on
block boundaries. Rows of q/k projections that llama.cpp's converter permuted within each head
are put back (`unpermute_qk`) on the rows read when they are whole heads, else on all rows.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """HF's row order of a q/k projection llama.cpp stored in its RoPE's (pairs adjacent
    elements, where HF pairs the two halves of each head)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


Range = tuple[int, int]


def _ranges(index: object, shape: list[int]) -> tuple[Range, Range | None] | None:
    """(rows, columns) of an index of contiguous ranges (``[a:b]``, ``[:, a:b]``, ``[...]``: all),
    else None."""
    parts = () if index is Ellipsis else index if isinstance(index, tuple) else (index,)
    if len(parts) > len(shape) or not all(isinstance(p, slice) for p in parts):
        return None
    ranges = []
    for part, size in zip(parts, shape, strict=False):
        start, stop, step = part.indices(size)
        if step != 1 or stop < start:
            return None
        ranges.append((start, stop))
    rows = ranges[0] if ranges else (0, shape[0])
    cols = ranges[1] if len(ranges) > 1 else None
    return rows, cols


class GGUFTensor:
    def __init__(
        self,
        data: np.ndarray,
        qtype: GGMLQuantizationType,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        raw: bool,
        heads: int | None,
    ) -> None:
        self._data = data  # the file's array: elements (F32, F16) or each row's bytes
        self._qtype = qtype
        self._shape = shape  # the float tensor's HF shape
        self._dtype = dtype
        self._heads = heads  # the q/k heads whose rows the converter permuted, or None
        self.gguf_type: int | None = int(qtype) if raw else None
        """The block type of raw blocks (what the ``gguf`` method reads); None: float."""

    def get_shape(self) -> list[int]:
        return list(self._data.shape if self.gguf_type is not None else self._shape)

    def __getitem__(self, index: object) -> torch.Tensor:
        shape = self.get_shape()
        ranges = _ranges(index, shape)
        if ranges is None or len(shape) != 2:  # one read of everything, then torch's indexing
            return self._read((0, shape[0]), None)[index]  # type: ignore[index]
        return self._read(*ranges)

    def _read(self, rows: Range, cols: Range | None) -> torch.Tensor:
        data, (r0, r1) = self._data, rows
        heads = self._heads
        per_head = data.shape[0] // heads if heads else 0
        whole_heads = not heads or (r0 % per_head == 0 and r1 % per_head == 0)
        read_rows = (r0, r1) if whole_heads else (0, data.shape[0])
        array = data[read_rows[0] : read_rows[1]]
        trim: Range | None = None
        if cols is not None and data.ndim == 2:
            array, trim = self._columns(array, cols)
        if self.gguf_type is None:
            values = dequantize(array, self._qtype)
            array = values.reshape(-1) if data.ndim == 1 else values.reshape(array.shape[0], -1)
            if trim is not None:
                array = array[:, trim[0] : trim[1]]
        if heads:
            array = unpermute_qk(array, (read_rows[1] - read_rows[0]) // per_head)
        if not whole_heads:
            array = array[r0:r1]
        if self.gguf_type is not None:
            blocks = torch.from_numpy(np.array(array, order="C"))  # a copy: the map is read-only
            blocks.gguf_type = self.gguf_type  # type: ignore[attr-defined]
            return blocks
        return torch.from_numpy(np.array(array, dtype=np.float32, order="C")).to(self._dtype)

    def _columns(self, array: np.ndarray, cols: Range) -> tuple[np.ndarray, Range | None]:
        """The stored columns holding ``cols``, and the range of ``cols`` in them once
        dequantized (None for raw blocks, whose columns are the bytes asked for)."""
        c0, c1 = cols
        if self.gguf_type is not None or array.dtype != np.uint8:  # bytes asked, or elements
            return array[:, c0:c1], None if self.gguf_type is not None else (0, c1 - c0)
        block_size, type_size = GGML_QUANT_SIZES[self._qtype]
        b0, b1 = c0 // block_size, -(-c1 // block_size)
        covering = array[:, b0 * type_size : b1 * type_size]
        return covering, (c0 - b0 * block_size, c1 - b0 * block_size)
