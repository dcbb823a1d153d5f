"""`Fp8Scheme`: how one model's linear layers are quantized (what every other module reads)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

WeightGranularity = Literal["tensor", "channel", "block"]
ActivationGranularity = Literal["tensor", "token", "group"]

BLOCK = (128, 128)
"""The one weight block (output rows, input columns) the block-scaled GEMM takes."""


@dataclass(frozen=True)
class Fp8Scheme:
    weights: WeightGranularity
    """One scale per weight matrix, per output row, or per 128x128 block."""
    activations: ActivationGranularity
    """One activation scale per tensor, per token (row), or per 128-column group of a token."""
    static_activations: bool = False
    """Activation scales calibrated into the checkpoint (``input_scale``), else computed per call."""
    serialized: bool = False
    """The checkpoint holds float8 weights and their scales (else float weights, quantized at load)."""
    scale_name: str = "weight_scale"
    """The checkpoint's name for the weight scales (Fp8Config's block format: ``weight_scale_inv``)."""
    ignored: tuple[str, ...] = field(default=())
    """Checkpoint layer names (or ``re:`` patterns) left unquantized."""
    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    """The float8 format the layers hold and compute in: the platform's (`Platform.fp8_dtype`),
    set when the model is built. float8_e4m3fnuz (AMD CDNA3): online quantization writes it
    directly, and a checkpoint's float8_e4m3fn weights are converted at load
    (`pagellm.quantization.fp8_formats.e4m3fn_to_e4m3fnuz`)."""
