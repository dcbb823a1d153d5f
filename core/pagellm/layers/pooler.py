"""`Pooler`: a pooling model's last hidden states → one vector per prompt (mean, CLS or last
token), in float32. Normalization is per request, in the front end (`PoolingParams.normalize`)."""

from __future__ import annotations

import torch
from torch import nn

from pagellm.config import PoolerConfig


class Pooler(nn.Module):
    def __init__(self, config: PoolerConfig) -> None:
        super().__init__()
        self.pooling_type = config.pooling_type

    def forward(
        self, hidden: torch.Tensor, query_start: torch.Tensor, query_lens: torch.Tensor
    ) -> torch.Tensor:
        """``hidden`` [T, H]: a step's flattened tokens; row r's prompt is the ``query_lens[r]``
        tokens from ``query_start[r]`` (int64 on the device, whole prompts: pooling models run
        without chunked prefill). Returns [rows, H] float32."""
        if self.pooling_type == "CLS":
            return hidden.index_select(0, query_start).float()
        if self.pooling_type == "LAST":
            return hidden.index_select(0, query_start + query_lens - 1).float()
        rows = torch.arange(len(query_lens), device=hidden.device)
        row_of_token = torch.repeat_interleave(rows, query_lens, output_size=hidden.shape[0])
        sums = torch.zeros(len(query_lens), hidden.shape[1], device=hidden.device)
        sums.index_add_(0, row_of_token, hidden.float())
        return sums / query_lens.unsqueeze(1).float()
