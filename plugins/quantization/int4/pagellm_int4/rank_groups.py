"""A row-parallel rank's quantization groups: its slice of ``g_idx`` names the checkpoint's
groups (those of its input features), renumbered here to the groups the rank holds.

Without act-order the rank's inputs are whole consecutive groups and it read only their scales
and zeros: renumbering subtracts its first group. With act-order (GPTQ ``desc_act``,
compressed-tensors ``actorder: group``) a group's inputs may lie anywhere along K, so every
rank read every group's scales and zeros and keeps those its inputs use, provided it holds each
of them whole (``static_groups`` checkpoints, whose act order keeps groups contiguous, do);
otherwise its kernels, which index groups as ``k // group_size`` after sorting the inputs by
group, cannot run that rank's part, and loading is refused.
"""

from __future__ import annotations

import torch

from pagellm.layers.parallel_linear import TensorParallelError
from pagellm.quantization import LayerSplit
from pagellm_int4.int4_values import Int4Values


def rank_groups(values: Int4Values, group_size: int, split: LayerSplit, name: str) -> Int4Values:
    """``values`` of a row-parallel rank (``g_idx`` in the checkpoint's group numbers) with
    ``g_idx`` numbering the groups it keeps, and only those groups' scales and zeros."""
    groups, local = torch.unique(values.g_idx, sorted=True, return_inverse=True)
    counts = torch.bincount(local, minlength=groups.numel())
    partial = int((counts != group_size).sum())
    if partial:
        k = values.in_features
        start = split.rank * k
        raise TensorParallelError(
            f"{name}: act-order g_idx scatters quantization groups over the input features, so "
            f"rank {split.rank}'s input features [{start}, {start + k}) of "
            f"{split.full_in_features} hold only part of {partial} of the {groups.numel()} "
            f"groups they use; pagellm-int4's kernels need each rank's groups whole of "
            f"{group_size} inputs: serve this checkpoint with tensor_parallel_size 1, or use one "
            "quantized without act-order (desc_act false) or with static groups."
        )
    scales, zeros = values.scales, values.zeros
    if scales.shape[0] != groups.numel():  # every group read (act order): keep the rank's
        scales, zeros = scales[groups], zeros[groups]
    return Int4Values(q=values.q, zeros=zeros, scales=scales, g_idx=local)
