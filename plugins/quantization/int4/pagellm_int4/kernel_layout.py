"""The one layout every format is repacked into after loading, what the kernels and the
reference path read:

- ``qweight`` int32 [ceil(K/128) * 16, N], *tile-interleaved*: the rows (in kernel order, padded
  with zero codes to a multiple of ``TILE_K`` = 128) go in tiles of 128, each tile in 16 word
  rows; nibble ``i`` (bits 4i..4i+3) of word row ``r`` of tile ``t`` holds row
  ``128 t + 16 i + r``. A kernel loading a tile's 16 x N words gets, from nibble i, the codes of
  16 *consecutive* rows: their activations are one contiguous load;
- ``scales`` float32 [G, N] and ``zeros`` uint8 [G, N]: group g covers kernel-order rows
  ``g * group_size .. (g + 1) * group_size - 1``;
- ``perm`` int64 [K] or None: kernel-order row i is the checkpoint's input column ``perm[i]``,
  so activations are gathered ``x[:, perm]`` before the GEMM. It is set only for act-order
  checkpoints (GPTQ ``desc_act``), whose ``g_idx`` scatters each group's columns over K: sorting
  the rows by group makes every group contiguous, so the kernels index groups as ``k // group_size``.

``w[n, perm[i]] = (q[i, n] - zeros[i // group_size, n]) * scales[i // group_size, n]``
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm_int4.int4_values import Int4Values

TILE_K = 128
"""Input rows per interleaved tile (eight slabs of 16 rows: the K of one tensor-core product)."""
_SLAB = TILE_K // 8


def pack_tiles(q: torch.Tensor) -> torch.Tensor:
    """[K, N] 4-bit codes (uint8) -> the tile-interleaved int32 words [ceil(K/128) * 16, N]."""
    k, n = q.shape
    tiles = -(-k // TILE_K)
    padded = torch.zeros(tiles * TILE_K, n, dtype=torch.int32, device=q.device)
    padded[:k] = q.to(torch.int32) & 0xF
    slabs = padded.view(tiles, 8, _SLAB, n)  # [tile, nibble i, word row r, N]
    words = torch.zeros(tiles, _SLAB, n, dtype=torch.int32, device=q.device)
    for i in range(8):  # int32 throughout; the top nibble sets bit 31 (the sign)
        words |= slabs[:, i] << (4 * i)
    return words.view(tiles * _SLAB, n)


def unpack_tiles(words: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of `pack_tiles`: [K, N] uint8 codes."""
    n = words.shape[1]
    tiled = words.view(-1, 1, _SLAB, n)
    shifts = (4 * torch.arange(8, device=words.device, dtype=torch.int32)).view(1, 8, 1, 1)
    codes = (tiled >> shifts) & 0xF  # [tile, i, r, N]
    return codes.reshape(-1, n)[:k].to(torch.uint8)


@dataclass
class KernelLayout:
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    perm: torch.Tensor | None
    group_size: int
    in_features: int


def act_order_permutation(values: Int4Values, group_size: int, name: str) -> torch.Tensor | None:
    """The rows' order that makes every group contiguous (None: they already are)."""
    k = values.in_features
    g_idx = values.g_idx
    sequential = torch.arange(k, device=g_idx.device) // group_size
    if torch.equal(g_idx, sequential):
        return None
    counts = torch.bincount(g_idx, minlength=values.scales.shape[0])
    if (
        g_idx.min() < 0
        or counts.numel() != values.scales.shape[0]
        or bool((counts != group_size).any())
    ):
        raise ValueError(
            f"{name}: g_idx does not give each of the {values.scales.shape[0]} groups "
            f"{group_size} input columns (counts {counts.tolist()[:8]}...); pagellm-int4 "
            "reorders act-order weights into contiguous groups and needs equal groups."
        )
    return torch.argsort(g_idx, stable=True)


def to_kernel_layout(values: Int4Values, group_size: int, name: str) -> KernelLayout:
    """Repack ``values`` (``group_size`` columns a group; K for one group)."""
    q, perm = values.q, act_order_permutation(values, group_size, name)
    if perm is not None:
        q = q[perm]
    return KernelLayout(
        qweight=pack_tiles(q),
        scales=values.scales.float().contiguous(),
        zeros=values.zeros.contiguous(),
        perm=perm,
        group_size=group_size,
        in_features=values.in_features,
    )


def dequantize(layout: KernelLayout, dtype: torch.dtype) -> torch.Tensor:
    """The weight [K, N] in kernel order (rows permuted by ``perm``), in ``dtype``: float32 math,
    one rounding at the end (what the Triton kernels compute)."""
    k = layout.in_features
    q = unpack_tiles(layout.qweight, k).float()
    g = torch.arange(k, device=q.device) // layout.group_size
    return ((q - layout.zeros[g].float()) * layout.scales[g]).to(dtype)
