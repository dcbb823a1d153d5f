"""The layout the CUDA kernels (``cuda/w4a16_mma.cu``) read: each 16 x 64 tile of codes (16 input
rows, 64 output columns) in 512 bytes, 16 a lane of a warp, so that one 16-byte load gives a
lane the A fragments of four ``mma.m16n8k16`` (the product is transposed, out^T = W^T x^T: the
weights are the A operand, 16 output columns x 16 inputs an MMA).

Lane ``l`` (``g = l // 4``, ``c = l % 4``) holds four words; word ``j`` serves columns
``16 j .. 16 j + 15`` of the strip, its register ``i`` (0..3) being the A fragment register
``a_i``: the 16-bit half ``e`` (0: low, 1: high) of ``a_i`` is the code of

    column 16 j + g + 8 (i % 2),  input row 16 kt + 2 c + 8 (i // 2) + e

(the PTX ISA's fragment of the m16n8k16 A matrix, row = output column, column = input row),
stored in bits ``4 i + 16 e .. +3`` of the word, so one LOP3 of ``word >> 4 i`` with
``0x000f000f`` yields both halves of ``a_i``. Tiles go strip by strip (64 columns), each strip
in input order: a warp streams a run of K contiguously.

- ``words`` int32, flat: [ceil(N/64), ceil(K/16), 32 lanes, 4 words], then ``PAD_TILES`` tiles of
  zeros (the kernels load up to that many tiles past a run's end, and ignore them);
- ``scales`` float32 and ``zeros`` uint8 [G, ceil(N/64) * 64], columns permuted within each
  strip so that a lane's eight (``16 j + g + 8 h`` for j < 4, h < 2) are contiguous, at
  ``8 g + 2 j + h``;
- ``perm`` as in `pagellm_int4.kernel_layout` (act-order: activations gathered first).

``w[n, perm[k]] = (q[k, n] - zeros[k // group_size, n]) * scales[k // group_size, n]``
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagellm_int4.int4_values import Int4Values
from pagellm_int4.kernel_layout import act_order_permutation

FRAG_K = 16
FRAG_N = 64
PAD_TILES = 24
"""Tiles of zeros after the last one: how far past a run's last step the GEMM may read (its
loads: the ring's depth plus a pass of its loop, at most 8 + 8 - 1; its L2 prefetches: 16
steps ahead plus a pass, at most 16 + 8 - 1)."""
_WORDS_PER_TILE = 32 * 4


def _lane_map(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every (lane, word j, register i, half e): the tile's column, input row and bit."""
    lane = torch.arange(32, device=device).view(32, 1, 1, 1)
    j = torch.arange(4, device=device).view(1, 4, 1, 1)
    i = torch.arange(4, device=device).view(1, 1, 4, 1)
    e = torch.arange(2, device=device).view(1, 1, 1, 2)
    g, c = lane // 4, lane % 4
    col = 16 * j + g + 8 * (i % 2)
    row = 2 * c + 8 * (i // 2) + e
    bit = 4 * i + 16 * e
    shape = (32, 4, 4, 2)
    return col.expand(shape), row.expand(shape), bit.expand(shape)


def strip_order(device: torch.device) -> torch.Tensor:
    """int64 [64]: position p of a strip holds column ``order[p]`` (``p = 8 g + 2 j + h``)."""
    p = torch.arange(FRAG_N, device=device)
    g, j, h = p // 8, (p % 8) // 2, p % 2
    return 16 * j + g + 8 * h


def pack_fragments(q: torch.Tensor) -> torch.Tensor:
    """[K, N] codes (uint8, 0..15) -> the flat int32 words (``PAD_TILES`` tiles of padding).

    One permutation of the codes, in bytes: a tile's input row ``2 c + 8 i1 + e`` is the
    index (i1, c, e) and its column ``16 j + 8 i0 + g`` the index (j, i0, g), with ``i = 2 i1 +
    i0``; lane (g, c)'s word j holds nibble ``b = 4 e + 2 i1 + i0`` at bits ``4 b``, so nibbles
    b = 2 m, 2 m + 1 make the word's byte m (little-endian)."""
    k, n = q.shape
    k16, n64 = -(-k // FRAG_K), -(-n // FRAG_N)
    codes = torch.zeros(k16 * FRAG_K, n64 * FRAG_N, dtype=torch.uint8, device=q.device)
    codes[:k, :n] = q.to(torch.uint8) & 0xF
    # [k16, i1, c, e, n64, j, i0, g] -> [n64, k16, g, c, j, e, i1, i0]
    nibbles = codes.view(k16, 2, 4, 2, n64, 4, 2, 8).permute(4, 0, 7, 2, 5, 3, 1, 6)
    nibbles = nibbles.reshape(n64, k16, 32, 4, 4, 2)
    words = (nibbles[..., 0] | (nibbles[..., 1] << 4)).contiguous().view(torch.int32)
    flat = torch.zeros(
        n64 * k16 * _WORDS_PER_TILE + PAD_TILES * _WORDS_PER_TILE,
        dtype=torch.int32,
        device=q.device,
    )
    flat[: n64 * k16 * _WORDS_PER_TILE] = words.reshape(-1)
    return flat


def unpack_fragments(words: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """The inverse of `pack_fragments`: [K, N] uint8 codes."""
    k16, n64 = -(-k // FRAG_K), -(-n // FRAG_N)
    tiles = words[: n64 * k16 * _WORDS_PER_TILE].view(n64, k16, 32, 4)
    codes = torch.zeros(k16, FRAG_K, n64, FRAG_N, dtype=torch.int32, device=words.device)
    col, row, bit = _lane_map(words.device)
    for i in range(4):
        for e in range(2):
            nib = (tiles >> (4 * i + 16 * e)) & 0xF  # [n64, k16, 32, 4]
            codes[:, row[:, :, i, e], :, col[:, :, i, e]] = nib.permute(2, 3, 1, 0)
    return codes.view(k16 * FRAG_K, n64 * FRAG_N)[:k, :n].to(torch.uint8)


def permute_strips(t: torch.Tensor) -> torch.Tensor:
    """[G, N] per-column values -> [G, ceil(N/64) * 64] in strip order (padding: zeros)."""
    g, n = t.shape
    n64 = -(-n // FRAG_N)
    padded = torch.zeros(g, n64 * FRAG_N, dtype=t.dtype, device=t.device)
    padded[:, :n] = t
    order = strip_order(t.device)
    return padded.view(g, n64, FRAG_N)[:, :, order].reshape(g, n64 * FRAG_N).contiguous()


def unpermute_strips(t: torch.Tensor, n: int) -> torch.Tensor:
    g = t.shape[0]
    order = strip_order(t.device)
    out = torch.empty_like(t).view(g, -1, FRAG_N)
    out[:, :, order] = t.view(g, -1, FRAG_N)
    return out.reshape(g, -1)[:, :n]


@dataclass
class FragmentLayout:
    words: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    perm: torch.Tensor | None
    group_size: int
    in_features: int
    out_features: int
    launches: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    """The CUDA GEMM's kernel name and prepared launch arguments by launch shape (`cuda.kernels`)."""

    @property
    def qweight(self) -> torch.Tensor:
        """The packed codes under the name every int4 layout gives them (``words``)."""
        return self.words

    @property
    def k16(self) -> int:
        return -(-self.in_features // FRAG_K)

    @property
    def n64(self) -> int:
        return -(-self.out_features // FRAG_N)

    @property
    def steps_per_group(self) -> int:
        """16-row steps a quantization group spans (the whole K for one group)."""
        if self.group_size >= self.in_features:
            return self.k16
        return self.group_size // FRAG_K


def fragment_layout_problem(in_features: int, group_size: int) -> str | None:
    """Why the CUDA kernels cannot take a layer of this shape (None: they can)."""
    if in_features % FRAG_K:
        return f"its {in_features} input features are not a multiple of {FRAG_K}"
    if group_size < in_features and group_size % FRAG_K:
        return f"its group size {group_size} is not a multiple of {FRAG_K}"
    return None


def to_fragment_layout(values: Int4Values, group_size: int, name: str) -> FragmentLayout:
    q, perm = values.q, act_order_permutation(values, group_size, name)
    if perm is not None:
        q = q[perm]
    k, n = q.shape
    return FragmentLayout(
        words=pack_fragments(q),
        scales=permute_strips(values.scales.float()),
        zeros=permute_strips(values.zeros),
        perm=perm,
        group_size=group_size,
        in_features=k,
        out_features=n,
    )


def dequantize_fragments(layout: FragmentLayout, dtype: torch.dtype) -> torch.Tensor:
    """The weight [K, N] in kernel order, float32 math and one rounding (the reference's)."""
    k, n = layout.in_features, layout.out_features
    q = unpack_fragments(layout.words, k, n).float()
    scales = unpermute_strips(layout.scales, n)
    zeros = unpermute_strips(layout.zeros, n).float()
    g = torch.arange(k, device=q.device) // layout.group_size
    return ((q - zeros[g]) * scales[g]).to(dtype)
