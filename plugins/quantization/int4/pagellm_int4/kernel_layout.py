"""The one layout every format is repacked into after loading, what the kernels and the
reference path read:

- ``qweight`` int32 [ceil(K/8), N]: eight consecutive input rows a word, low nibble first
  (GPTQ's ``qweight`` layout, padded with zero nibbles when K is not a multiple of 8), rows in
  *kernel order*;
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
from pagellm_int4.packing import pack_rows, unpack_rows


@dataclass
class KernelLayout:
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    perm: torch.Tensor | None
    group_size: int
    in_features: int


def to_kernel_layout(values: Int4Values, group_size: int, name: str) -> KernelLayout:
    """Repack ``values`` (``group_size`` columns a group; K for one group)."""
    k = values.in_features
    g_idx = values.g_idx
    sequential = torch.arange(k, device=g_idx.device) // group_size
    q, perm = values.q, None
    if not torch.equal(g_idx, sequential):
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
        perm = torch.argsort(g_idx, stable=True)
        q = q[perm]
    return KernelLayout(
        qweight=pack_rows(q),
        scales=values.scales.float().contiguous(),
        zeros=values.zeros.contiguous(),
        perm=perm,
        group_size=group_size,
        in_features=k,
    )


def dequantize(layout: KernelLayout, dtype: torch.dtype) -> torch.Tensor:
    """The weight [K, N] in kernel order (rows permuted by ``perm``), in ``dtype``: float32 math,
    one rounding at the end (what the Triton kernels compute)."""
    k = layout.in_features
    q = unpack_rows(layout.qweight, k).float()
    g = torch.arange(k, device=q.device) // layout.group_size
    return ((q - layout.zeros[g].float()) * layout.scales[g]).to(dtype)
