"""`Int4Values`: a 4-bit weight unpacked, whatever format it came from; what the checkpoint
readers produce, the writers consume, and the kernel layout is built from.

``w[n, k] = (q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n]``"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Int4Values:
    q: torch.Tensor
    """uint8 [K, N], 0..15."""
    zeros: torch.Tensor
    """uint8 [G, N]: the value subtracted from q (8 when symmetric; 1..16 from a GPTQ v1
    checkpoint, which stores it minus one in a nibble)."""
    scales: torch.Tensor
    """float32 [G, N]."""
    g_idx: torch.Tensor
    """int64 [K]: the group of each input column."""

    @property
    def in_features(self) -> int:
        return int(self.q.shape[0])

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K]."""
        g = self.g_idx
        w = (self.q.float() - self.zeros[g].float()) * self.scales[g]
        return w.t().contiguous()


def sequential_g_idx(in_features: int, group_size: int, device: torch.device) -> torch.Tensor:
    """Input column k in group k // group_size (no act-order)."""
    return torch.arange(in_features, device=device) // group_size
